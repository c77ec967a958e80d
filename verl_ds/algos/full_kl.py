"""The exact full-vocabulary symmetric KL 0.5 (KL(p||q) + KL(q||p)) (``algo.kl_kind=full_symmetric``, docs/config.md)
from two models' logits, or from their LM-head inputs a chunk of tokens at a time; the sampled-token estimators are in
``verl_ds.algos.kl``, the Triton kernel in ``verl_ds.kernels.symkl``.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable
from torch.nn.functional import linear

from ..kernels import dispatch
from ._checks import check_float_tensor, check_positive_number, check_same_shape
from ._chunks import as_row_blocks, chunk_plan, chunk_rows_of
from .logprob import rows_per_chunk

_LN2 = math.log(2.0)


class _SymmetricKL(torch.autograd.Function):
    """0.5 sum_v (p_v - q_v)(x_v - y_v), x = logits/t, y = ref/t, per chunk -> (N,) float32; D = x - y, backward:
    dJ/dx_v = 0.5 (p_v (D_v - E_p[D]) + p_v - q_v), dJ/dy_v = 0.5 (q_v (E_q[D] - D_v) + q_v - p_v)."""

    @staticmethod
    def forward(ctx, logits, ref_logits, inv_t: float, rows: int):
        v = logits.shape[-1]
        n = logits.numel() // v
        dev = logits.device
        out = torch.empty(n, dtype=torch.float32, device=dev)
        e_p = torch.empty(n, dtype=torch.float32, device=dev)
        e_q = torch.empty(n, dtype=torch.float32, device=dev)
        rows = min(rows, max(logits.shape[-2], 1))
        chunks = chunk_plan(logits, rows)

        bufs = [torch.empty(rows, v, dtype=torch.float32, device=dev) for _ in range(3)]
        for chunk in chunks:
            p, q, d = _chunk_stats(chunk_rows_of(logits, chunk), chunk_rows_of(ref_logits, chunk), inv_t, bufs)
            r, f0 = p.shape[0], chunk[3]
            # nansum: 0 * (-inf) where one side masks an entry the other may not; d is in base 2
            ep = torch.mul(p, d, out=p).nansum(dim=1).mul_(_LN2)
            eq = torch.mul(q, d, out=q).nansum(dim=1).mul_(_LN2)
            e_p[f0:f0 + r] = ep
            e_q[f0:f0 + r] = eq
            out[f0:f0 + r] = 0.5 * (ep - eq)
        ctx.save_for_backward(logits, ref_logits, e_p, e_q)
        ctx.inv_t, ctx.rows = inv_t, rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        logits, ref_logits, e_p, e_q = ctx.saved_tensors
        inv_t, rows = ctx.inv_t, ctx.rows
        want_x, want_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        v = logits.shape[-1]
        dev = logits.device
        gx = torch.empty(logits.shape, dtype=logits.dtype, device=dev) if want_x else None
        gy = torch.empty(ref_logits.shape, dtype=ref_logits.dtype, device=dev) if want_y else None
        scale = (0.5 * inv_t) * g.to(torch.float32)  # chain rule through x = logits / t
        chunks = chunk_plan(logits, rows)

        bufs = [torch.empty(rows, v, dtype=torch.float32, device=dev) for _ in range(4)]
        for chunk in chunks:
            p, q, d = _chunk_stats(chunk_rows_of(logits, chunk), chunk_rows_of(ref_logits, chunk), inv_t, bufs)
            r, f0 = p.shape[0], chunk[3]
            sc = scale[f0:f0 + r, None]
            tmp = bufs[3][:r]
            if want_x:
                # p (D - E_p[D] + 1) - q, D = ln2 d
                torch.add((1.0 - e_p[f0:f0 + r])[:, None], d, alpha=_LN2, out=tmp).mul_(p).sub_(q).mul_(sc)
                chunk_rows_of(gx, chunk).copy_(tmp)
            if want_y:
                # q (E_q[D] + 1 - D) - p
                torch.add((e_q[f0:f0 + r] + 1.0)[:, None], d, alpha=-_LN2, out=tmp).mul_(q).sub_(p).mul_(sc)
                chunk_rows_of(gy, chunk).copy_(tmp)
        return gx, gy, None, None


def _chunk_stats(c, c_ref, inv_t, bufs):
    """softmax(c/t), softmax(c_ref/t) and D / ln2 for one chunk in the fp32 scratch bufs; base 2 because exp2 is
    cheaper than exp at the same accuracy (benchmarks/README.md)."""
    r = c.shape[0]
    p, q, d = bufs[0][:r], bufs[1][:r], bufs[2][:r]
    # x/(t ln2) in fp32 (a (1, 1) fp32 scale promotes bf16/fp16 chunks in the same pass)
    scale = torch.full((1, 1), inv_t / _LN2, dtype=torch.float32, device=c.device)
    torch.mul(c, scale, out=p)
    torch.mul(c_ref, scale, out=q)
    torch.sub(p, q, out=d)
    # a vocabulary entry masked (-inf) in both gives NaN here; it carries no mass in either, so D = 0
    d.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    for x in (p, q):
        x.sub_(x.amax(dim=1, keepdim=True)).exp2_()
        x.div_(x.sum(dim=1, keepdim=True))
    return p, q, d


def full_symmetric_kl_torch(logits2d: torch.Tensor, ref_logits2d: torch.Tensor, temperature: float = 1.0, *,
                            chunk_rows: int | None = None) -> torch.Tensor:
    """Torch path of :func:`full_symmetric_kl` (no checks), flat (N,) float32: the Triton kernel's test reference."""
    rows = rows_per_chunk(logits2d.shape[-1], logits2d.device, chunk_rows)
    return _SymmetricKL.apply(logits2d, ref_logits2d, 1.0 / float(temperature), rows)


def _same_row_blocks(logits, ref_logits):
    x, y = as_row_blocks(logits), as_row_blocks(ref_logits)
    if x.dim() != y.dim():  # one flattens, the other does not: use (B, T, V) views for both
        t, v = logits.shape[-2], logits.shape[-1]
        x, y = x.reshape(-1, t, v), y.reshape(-1, t, v)
    return x, y


def full_symmetric_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact 0.5 (KL(p||q) + KL(q||p)) per position (...) float32, p = softmax(logits/t), q = softmax(ref_logits/t),
    chunk by chunk with no (..., V) temporaries; differentiable (w.r.t. ref_logits too if it requires grad)."""
    check_float_tensor(logits, "logits")
    check_float_tensor(ref_logits, "ref_logits")
    check_same_shape(logits, "logits", ref_logits, "ref_logits")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got shape {tuple(logits.shape)}")
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits is on {ref_logits.device} but logits is on {logits.device}")
    temperature = check_positive_number(temperature, "temperature")
    x, y = _same_row_blocks(logits, ref_logits)
    # the kernel takes fp32/bf16/fp16 and treats ref_logits as a constant; other cases use the torch path
    if (x.dtype != torch.float64 and y.dtype != torch.float64 and not y.requires_grad
            and dispatch.backend_for(x) == "triton"):
        from verl_ds.kernels.symkl import full_symmetric_kl as kernel

        v = logits.shape[-1]
        out = kernel(x.reshape(-1, v), y.reshape(-1, v), temperature)  # a copy for (B, T, V) block views
    else:
        out = full_symmetric_kl_torch(x, y, temperature)
    return out.view(logits.shape[:-1])


# float32 logit elements per model per chunk of the head form: 2^22 (16 MiB) on CPUs, 2^26 (256 MiB) on GPUs
_HEAD_CPU_ELEMS, _HEAD_CUDA_ELEMS = 1 << 22, 1 << 26


class _HeadSymmetricKL(torch.autograd.Function):
    """No logits are kept: the backward recomputes each chunk's, with grad into the actor's h, W, b only, summed in
    float32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature: float, rows: int):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            out[r0:r1] = full_symmetric_kl(linear(hidden[r0:r1], weight, bias),
                                           linear(ref_hidden[r0:r1], ref_weight, ref_bias), temperature)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), ref_hidden, ref_weight,
                              ref_bias if ref_bias is not None else torch.empty(0))
        ctx.has_bias, ctx.has_ref_bias = bias is not None, ref_bias is not None
        ctx.temperature, ctx.rows = temperature, rows
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
                y = linear(ref_hidden[r0:r1], ref_weight, ref_bias)
            with torch.enable_grad():
                kl = full_symmetric_kl(linear(h, w, b), y, ctx.temperature)
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
        raise ValueError(f"the two LM heads must share the vocabulary, got {weight.shape[0]} and {ref_weight.shape[0]}")
    temperature = check_positive_number(temperature, "temperature")
    if chunk_rows is None:
        elems = _HEAD_CUDA_ELEMS if hidden.device.type == "cuda" else _HEAD_CPU_ELEMS
        chunk_rows = max(1, min(hidden.shape[0], elems // max(weight.shape[0], 1)))
    elif isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    ref = [t.detach() if t is not None else None for t in (ref_hidden, ref_weight, ref_bias)]
    return _HeadSymmetricKL.apply(hidden, weight, bias, ref[0], ref[1], ref[2], temperature, chunk_rows)
