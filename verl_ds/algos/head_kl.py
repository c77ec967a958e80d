"""The exact full-vocabulary symmetric KL between two models from their LM-head inputs (``algo.kl_kind=full_symmetric``
in the loss): :func:`verl_ds.algos.full_symmetric_kl` of ``chunk_rows`` tokens' logits at a time. No logits are kept;
the backward recomputes each chunk's, with grad into the actor's h, W, b only, summed in float32.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_float_tensor, check_positive_number
from .kl import full_symmetric_kl

__all__ = ["head_symmetric_kl", "default_kl_chunk_rows"]

# float32 logit elements per model per chunk: 2^22 (16 MiB) on CPUs, 2^26 (256 MiB) on GPUs
_CPU_CHUNK_ELEMS = 1 << 22
_CUDA_CHUNK_ELEMS = 1 << 26


def default_kl_chunk_rows(n: int, v: int, device: torch.device) -> int:
    elems = _CUDA_CHUNK_ELEMS if device.type == "cuda" else _CPU_CHUNK_ELEMS
    return max(1, min(max(n, 1), elems // max(v, 1)))


def _logits(h, w, b):
    return torch.nn.functional.linear(h, w, b)


class _HeadSymmetricKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature: float, rows: int):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            out[r0:r1] = full_symmetric_kl(_logits(hidden[r0:r1], weight, bias),
                                           _logits(ref_hidden[r0:r1], ref_weight, ref_bias), temperature)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), ref_hidden, ref_weight,
                              ref_bias if ref_bias is not None else torch.empty(0))
        ctx.has_bias, ctx.has_ref_bias, ctx.temperature, ctx.rows = bias is not None, ref_bias is not None, temperature, rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        ref_bias = ref_bias if ctx.has_ref_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        n, f32 = hidden.shape[0], torch.float32
        gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=f32, device=bias.device) if need_b else None
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        for r0 in range(0, n, ctx.rows):
            r1 = min(r0 + ctx.rows, n)
            h = hidden[r0:r1].detach().requires_grad_(need_h)
            with torch.no_grad():
                y = _logits(ref_hidden[r0:r1], ref_weight, ref_bias)
            with torch.enable_grad():
                kl = full_symmetric_kl(_logits(h, w, b), y, ctx.temperature)
                wrt = [t for t, want in ((h, need_h), (w, need_w), (b, need_b)) if want]
                grads = list(torch.autograd.grad(kl, wrt, g[r0:r1].to(kl.dtype)))
            if need_h:
                gh[r0:r1] = grads.pop(0)
            if need_w:
                gw += grads.pop(0)
            if need_b:
                gb += grads.pop(0)
        return (gh, gw.to(weight.dtype) if need_w else None, gb.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def head_symmetric_kl(hidden: torch.Tensor, weight: torch.Tensor, ref_hidden: torch.Tensor,
                      ref_weight: torch.Tensor, bias: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
                      temperature: float = 1.0, *, chunk_rows: int | None = None) -> torch.Tensor:
    """(N,) float32 exact 0.5 (KL(p||q) + KL(q||p)) per token, p = softmax((hidden W^T + bias)/t),
    q = softmax((ref_hidden U^T + ref_bias)/t), ``chunk_rows`` tokens at a time; no gradient to the reference."""
    for name, t in (("hidden", hidden), ("weight", weight), ("ref_hidden", ref_hidden), ("ref_weight", ref_weight)):
        check_float_tensor(t, name)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if hidden.shape[0] != ref_hidden.shape[0]:
        raise ValueError(f"hidden and ref_hidden must hold the same tokens, got {hidden.shape[0]} and "
                         f"{ref_hidden.shape[0]} rows")
    if hidden.shape[1] != weight.shape[1] or ref_hidden.shape[1] != ref_weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)} and ref_hidden "
                         f"{tuple(ref_hidden.shape)} / ref_weight {tuple(ref_weight.shape)} must share H pairwise")
    if weight.shape[0] != ref_weight.shape[0]:
        raise ValueError(f"the two LM heads must share the vocabulary, got V={weight.shape[0]} and "
                         f"{ref_weight.shape[0]}")
    temperature = check_positive_number(temperature, "temperature")
    rows = default_kl_chunk_rows(hidden.shape[0], weight.shape[0], hidden.device) if chunk_rows is None else chunk_rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    ref = [t.detach() if t is not None else None for t in (ref_hidden, ref_weight, ref_bias)]
    return _HeadSymmetricKL.apply(hidden, weight, bias, ref[0], ref[1], ref[2], temperature, rows)
