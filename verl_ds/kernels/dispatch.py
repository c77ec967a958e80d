"""Triton kernels or the torch paths of ``verl_ds.algos``: ``VERL_DS_KERNELS=auto`` (Triton for CUDA tensors when it
can launch), ``triton`` (forced; ``TRITON_INTERPRET=1`` runs it on CPU tensors, as the tests do) or ``torch``.
"""
from __future__ import annotations

import functools
import os

import torch

_CHOICES = ("auto", "triton", "torch")


def requested_backend() -> str:
    """The value of ``VERL_DS_KERNELS`` (default ``auto``), validated."""
    value = os.environ.get("VERL_DS_KERNELS", "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"VERL_DS_KERNELS={value!r} is not valid; expected one of {', '.join(_CHOICES)}")
    return value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_unavailable_reason() -> str | None:
    """None when Triton can launch kernels here, otherwise a sentence saying why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton cannot be imported ({type(exc).__name__}: {exc}); install it with `pip install triton`"
    if interpreting():
        return None
    if not torch.cuda.is_available():
        return ("no CUDA device is available and TRITON_INTERPRET is not set; "
                "set TRITON_INTERPRET=1 (before importing verl_ds) to run the kernels in Triton's CPU interpreter")
    return None


def backend_for(tensor: torch.Tensor) -> str:
    """'triton' or 'torch' for an op on ``tensor``, following ``VERL_DS_KERNELS``."""
    requested = requested_backend()
    if requested == "torch":
        return "torch"
    reason = triton_unavailable_reason()
    if requested == "triton":
        if reason is not None:
            raise RuntimeError(f"VERL_DS_KERNELS=triton was requested but {reason}")
        if tensor.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"VERL_DS_KERNELS=triton was requested for a tensor on {tensor.device}; Triton kernels need "
                "CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        return "triton"
    # auto: only CUDA tensors go to Triton (the interpreter is far slower than torch on CPU)
    if tensor.device.type == "cuda" and reason is None and not interpreting():
        return "triton"
    return "torch"
