"""verl_ds/kernels/dispatch.py and the kernels' own launch checks: VERL_DS_KERNELS and TRITON_INTERPRET."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_ds.kernels import dispatch
from verl_ds.kernels._utils import check_runnable
from verl_ds.kernels.logprob import logprobs_and_entropy


@pytest.mark.parametrize("value,expected", [("torch", "torch"), ("TRITON", "triton"), (" auto ", "auto"), ("", "auto")])
def test_requested_backend_reads_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("VERL_DS_KERNELS", value)
    assert dispatch.requested_backend() == expected


def test_requested_backend_default_and_bad_value(monkeypatch):
    monkeypatch.delenv("VERL_DS_KERNELS", raising=False)
    assert dispatch.requested_backend() == "auto"
    monkeypatch.setenv("VERL_DS_KERNELS", "cuda")
    with pytest.raises(ValueError, match="VERL_DS_KERNELS='cuda' is not valid; expected one of auto, triton, torch"):
        dispatch.requested_backend()
    with pytest.raises(ValueError, match="VERL_DS_KERNELS='cuda'"):
        dispatch.backend_for(torch.zeros(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-tensor routing; on a GPU auto picks triton for CUDA")
def test_backend_for_cpu_tensors_under_the_interpreter(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("VERL_DS_KERNELS", "auto")
    assert dispatch.backend_for(cpu) == "torch"  # auto never sends CPU tensors to the interpreter
    monkeypatch.setenv("VERL_DS_KERNELS", "torch")
    assert dispatch.backend_for(cpu) == "torch"
    monkeypatch.setenv("VERL_DS_KERNELS", "triton")
    assert dispatch.backend_for(cpu) == "triton"  # conftest set TRITON_INTERPRET=1


def test_interpreter_toggled_after_import_is_reported(monkeypatch):
    was_on = dispatch.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0" if was_on else "1")
    change = "unset" if was_on else "set"
    with pytest.raises(RuntimeError, match=f"TRITON_INTERPRET was {change} after verl_ds.kernels was imported"):
        check_runnable(torch.zeros(1), "logprobs_and_entropy")


def test_forced_triton_without_interpreter_on_cpu_says_why():
    # TRITON_INTERPRET is read when the kernels are defined, so this needs a fresh interpreter.
    script = textwrap.dedent("""
        import torch
        from verl_ds.kernels import dispatch
        from verl_ds.kernels.logprob import logprobs_and_entropy
        from verl_ds.kernels.gae import compute_gae
        x = torch.zeros(2, 5)
        for call in (lambda: dispatch.backend_for(x),
                     lambda: logprobs_and_entropy(x, torch.zeros(2, dtype=torch.long)),
                     lambda: compute_gae(x, x, x.bool(), 0.9, 0.9)):
            try:
                call()
            except RuntimeError as exc:
                print("RuntimeError:", exc)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(VERL_DS_KERNELS="triton", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    assert lines[0].startswith("RuntimeError: VERL_DS_KERNELS=triton was requested but no CUDA device")
    assert "set TRITON_INTERPRET=1" in lines[0]
    assert lines[1].startswith("RuntimeError: logprobs_and_entropy: the Triton kernel cannot run: no CUDA device")
    assert lines[2].startswith("RuntimeError: compute_gae: the Triton kernel cannot run")


def test_kernels_run_on_cpu_tensors_in_the_interpreter():
    if not dispatch.interpreting():
        pytest.skip("the interpreter is off (CUDA run of the suite)")
    logprob, _ = logprobs_and_entropy(torch.zeros(2, 4), torch.tensor([0, 3]))
    assert torch.allclose(logprob, torch.full((2,), -torch.log(torch.tensor(4.0))))
