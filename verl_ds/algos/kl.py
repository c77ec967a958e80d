"""KL estimators, a registry (``KL_KINDS``): per token from sampled log-probs (Schulman, "Approximating KL
Divergence", 2020, as verl's ``kl_penalty``), with d = log_probs - ref_log_probs: k1 = d, abs = |d|, k2 = d^2 / 2,
k3 = exp(-d) - 1 + d (>= 0, low variance), symmetric = 0.5 d (1 - exp(-d)) (>= 0, unbiased for 0.5 (KL(pi||ref) +
KL(ref||pi))), d clamped to [-20, 20] and k3 to [-10, 10] as verl; and the exact full-vocabulary symmetric KL.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_float_tensor, check_positive_number, check_same_shape
from ._chunks import as_row_blocks, chunk_plan, chunk_rows_of
from .logprob import rows_per_chunk
from .registry import Registry

KL_ESTIMATORS = Registry("KL kind", "kinds")
KL_KINDS = KL_ESTIMATORS.view()  # names and aliases, e.g. "k1", "kl", ...
_CLAMP_D = 20.0  # exp(20) ~ 5e8: large enough to be exact for any real policy, small enough to stay finite
_CLAMP_K3 = 10.0
_LN2 = math.log(2.0)


def register_kl_estimator(name: str, *, aliases: tuple = ()):
    """Decorator adding a per-token KL estimator ``fn(log_probs, ref_log_probs) -> tensor`` under ``name``."""
    return KL_ESTIMATORS.register(name, aliases=aliases)


@register_kl_estimator("k1", aliases=("kl",))
def _k1(log_probs, ref_log_probs):
    return log_probs - ref_log_probs


@register_kl_estimator("abs")
def _abs(log_probs, ref_log_probs):
    return (log_probs - ref_log_probs).abs()


@register_kl_estimator("k2", aliases=("mse",))
def _k2(log_probs, ref_log_probs):
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3", aliases=("low_var_kl",))
def _k3(log_probs, ref_log_probs):
    d = (log_probs - ref_log_probs).clamp(-_CLAMP_D, _CLAMP_D)
    return (torch.exp(-d) - 1.0 + d).clamp(-_CLAMP_K3, _CLAMP_K3)


@register_kl_estimator("symmetric")
def _symmetric(log_probs, ref_log_probs):
    d = (log_probs - ref_log_probs).clamp(-_CLAMP_D, _CLAMP_D)
    # -expm1(-d) = 1 - exp(-d) without cancellation near d = 0
    return 0.5 * d * -torch.expm1(-d)


FULL_SYMMETRIC = "full_symmetric"


@register_kl_estimator(FULL_SYMMETRIC)
def _full_symmetric_sampled(log_probs, ref_log_probs):
    # only the sampled tokens' log-probs are known here (the KL controller's observation): the unbiased estimate
    return _symmetric(log_probs, ref_log_probs)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the given ``kind`` from the sampled tokens' log-probs, float32, differentiable."""
    check_float_tensor(log_probs, "log_probs")
    check_float_tensor(ref_log_probs, "ref_log_probs")
    check_same_shape(log_probs, "log_probs", ref_log_probs, "ref_log_probs")
    fn = KL_ESTIMATORS.get(kind)
    return fn(log_probs.to(torch.float32), ref_log_probs.to(torch.float32)).to(torch.float32)


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
    from verl_ds.kernels import dispatch

    # the kernel takes fp32/bf16/fp16 and treats ref_logits as a constant; other cases use the torch path
    if (x.dtype != torch.float64 and y.dtype != torch.float64 and not y.requires_grad
            and dispatch.backend_for(x) == "triton"):
        from verl_ds.kernels.symkl import full_symmetric_kl as kernel

        v = logits.shape[-1]
        out = kernel(x.reshape(-1, v), y.reshape(-1, v), temperature)  # a copy for (B, T, V) block views
    else:
        out = full_symmetric_kl_torch(x, y, temperature)
    return out.view(logits.shape[:-1])
