"""Test-wide environment. TRITON_INTERPRET must be set before any module defining @triton.jit
kernels is imported, so the kernel tests can run the kernels on CPU tensors."""
import os
import sys

# launcher tests run `deepspeed`, `accelerate`, `torchrun`: the ones installed next to this interpreter,
# whether or not the venv was activated (`make test` calls .venv/bin/python directly)
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# --import-mode=importlib leaves sys.path alone: the shared helpers (e2e_utils) and each folder's own (server_testutil,
# models_testutil, ...) are imported by name from these folders (their names are unique across folders)
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _d in sorted(os.listdir(_TESTS), reverse=True):
    if os.path.isdir(os.path.join(_TESTS, _d)) and not _d.startswith((".", "_")):
        sys.path.insert(0, os.path.join(_TESTS, _d))
sys.path.insert(0, _TESTS)
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".torch_ext"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the drivers that will run
def pytest_collection_modifyitems(config, items):
    """The vLLM venv's test runs (tests/engines/vllm_testutil.py) start now, in the background at a lower CPU
    priority, and their driver tests move to the end of the session, where they await them."""
    drivers = [item for item in items if getattr(getattr(item, "function", None), "vllm_venv_file", None)]
    if not drivers:
        return
    from vllm_testutil import start_in_background

    items[:] = [item for item in items if item not in drivers] + drivers
    start_in_background([item.function.vllm_venv_file for item in drivers])


def pytest_sessionfinish(session, exitstatus):
    if "vllm_testutil" in sys.modules:
        sys.modules["vllm_testutil"].stop_background()
