"""Shared pieces of the kernels: launch checks, launch sizes and the online log-sum-exp row pass
(``row_softmax_stats``) behind the log-prob, entropy and KL kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dispatch

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. when this package is
# imported; remember what it was so a later change can be reported instead of failing obscurely.
INTERPRETING_AT_IMPORT = dispatch.interpreting()

# A finite stand-in for -inf as the initial running max: exp(m - m') and (m - m') * s stay finite
# (no inf - inf or 0 * inf), so rows holding -inf logits (masked vocabulary) do not produce NaN.
NEG_BIG = tl.constexpr(-3.0e38)


def check_runnable(tensor: torch.Tensor, op: str) -> None:
    reason = dispatch.triton_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"{op}: the Triton kernel cannot run: {reason}")
    if dispatch.interpreting() != INTERPRETING_AT_IMPORT:
        raise RuntimeError(
            f"{op}: TRITON_INTERPRET was {'set' if dispatch.interpreting() else 'unset'} after verl_ds.kernels "
            "was imported; Triton reads it at import time, so set it before importing verl_ds")
    if tensor.device.type != "cuda" and not dispatch.interpreting():
        raise RuntimeError(
            f"{op}: the Triton kernel got a tensor on {tensor.device}; it needs a CUDA tensor, or "
            "TRITON_INTERPRET=1 (set before importing verl_ds) to run on CPU tensors in Triton's interpreter")


def check_float_2d(name: str, tensor, n_rows: int | None = None) -> None:
    """Raise TypeError/ValueError unless ``tensor`` is a 2-D float32/bfloat16/float16 tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D (N, V), got shape {tuple(tensor.shape)}")
    if n_rows is not None and tensor.shape[0] != n_rows:
        raise ValueError(f"{name} must have {n_rows} rows, got shape {tuple(tensor.shape)}")


def check_labels(labels, n_rows: int, n_cols: int, ignore_index: int) -> None:
    """Raise unless ``labels`` is an int64 (N,) tensor; on CPU also check the range (free there, a sync on CUDA)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64, got {labels.dtype}")
    if labels.shape != (n_rows,):
        raise ValueError(f"labels must have shape ({n_rows},) to match the logits, got {tuple(labels.shape)}")
    if labels.device.type == "cpu" and n_rows:
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= n_cols))
        if bool(bad.any()):
            first = labels[bad][0].item()
            raise ValueError(f"labels must be in [0, {n_cols}) or equal ignore_index={ignore_index}, got {first}")


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a positive float, got {type(temperature).__name__}")
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a positive finite float, got {temperature}")
    return float(temperature)


def unit_col_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by a stride but need contiguous columns; copy only when they are not."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


# Set by benchmarks/kernel_speed.py --sweep to time other launch shapes; None in normal use.
VOCAB_LAUNCH_OVERRIDE: dict | None = None


def vocab_meta(n_cols: int) -> dict:
    """Launch sizes of the row-streaming kernels (one program per row): on CUDA 4096-wide blocks with 8 warps, no
    autotuning (hundreds of variants to compile); the interpreter pays per iteration, so it takes up to 32768."""
    if VOCAB_LAUNCH_OVERRIDE is not None:
        return dict(VOCAB_LAUNCH_OVERRIDE)
    block = max(16, min(triton.next_power_of_2(n_cols), 32768 if INTERPRETING_AT_IMPORT else 4096))
    return {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4}


# One read of a row keeps the running max m, s = sum e^{x - m} and t = sum e^{x - m} (x - m): lse = m + log s and
# H = log s - t / s. t relative to the running max avoids cancelling two numbers of size |x| (logits ~1e4). m and
# log s come back apart: log p_k = (x_k - m) - log s keeps a near-certain token's -1e-6, which x_k - (m + log s)
# rounds to 0 once m ~ 20. When the max moves to m', both sums scale by e^{m - m'} and t also gains (m - m') s.
@triton.jit
def row_softmax_stats(row_ptr, n_cols, inv_temperature, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """One online pass over x = ``row_ptr[0:n_cols] * inv_temperature`` -> (max x, log sum e^{x - max}, entropy) in
    fp32; ``n_cols == 0`` (an ignored row) runs no iteration and returns junk the caller overwrites."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), NEG_BIG, tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        # 1. Load a block; padding columns read -inf so they add e^-inf = 0 to every sum.
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_temperature
        # 2. Move the running max and rescale what was summed under the old one.
        m_new = tl.maximum(m, tl.max(x, 0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        if WITH_ENTROPY:
            # e == 0 covers padding and -inf logits, whose (x - m') is -inf and would make 0 * -inf.
            xs = tl.where(e > 0, x - m_new, 0.0)
            t = alpha * (t + (m - m_new) * s) + tl.sum(e * xs, 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
    s = tl.maximum(s, 1e-30)  # s >= 1 on a real row (its max adds e^0); only an empty row has s = 0
    log_s = tl.log(s)
    entropy = log_s - t / s
    return m, log_s, entropy
