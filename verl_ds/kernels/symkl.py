"""Full-vocabulary symmetric KL between actor and reference logits in one online pass over both rows (torch twin:
``verl_ds.algos.full_kl.full_symmetric_kl_torch``): J = 1/2 (KL(p||q) + KL(q||p)) = 1/2 (E_p[d] - E_q[d]), d = x - y,
x = logits / T, y = ref_logits / T (the log-sum-exps cancel). No gradient flows to the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import NEG_BIG, check_float_2d, check_runnable, check_temperature, unit_col_stride, vocab_meta


@triton.jit
def _symkl_fwd_kernel(
    x_ptr, x_row_stride, y_ptr, y_row_stride, kl_ptr, stats_ptr, n_rows, n_cols, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    m_x = tl.full((), NEG_BIG, tl.float32)
    m_y = tl.full((), NEG_BIG, tl.float32)
    s_x = tl.zeros((), tl.float32)  # sum e^{x - m_x}
    s_y = tl.zeros((), tl.float32)
    a = tl.zeros((), tl.float32)  # sum e^{x - m_x} d   -> E_p[d] = a / s_x
    b = tl.zeros((), tl.float32)  # sum e^{y - m_y} d   -> E_q[d] = b / s_y
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        # 1. Both blocks; padding reads -inf so its weights e^{-inf} are 0.
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=float("-inf"))
        y = tl.load(y_ptr + row * y_row_stride + cols, mask=cols < n_cols, other=float("-inf"))
        x = x.to(tl.float32) * inv_temperature
        y = y.to(tl.float32) * inv_temperature
        # 2. Two online softmaxes; d itself needs no rescaling, only the weights do.
        mx_new = tl.maximum(m_x, tl.max(x, 0))
        my_new = tl.maximum(m_y, tl.max(y, 0))
        alpha_x = tl.exp(m_x - mx_new)
        alpha_y = tl.exp(m_y - my_new)
        ex = tl.exp(x - mx_new)
        ey = tl.exp(y - my_new)
        d = x - y
        # zero weight -> zero term, also where d is -inf - -inf (padding, masked vocabulary)
        a = a * alpha_x + tl.sum(tl.where(ex > 0, ex * d, 0.0), 0)
        b = b * alpha_y + tl.sum(tl.where(ey > 0, ey * d, 0.0), 0)
        s_x = s_x * alpha_x + tl.sum(ex, 0)
        s_y = s_y * alpha_y + tl.sum(ey, 0)
        m_x = mx_new
        m_y = my_new
    # 3. J >= 0 holds exactly; clamp the rounding (the gradient is taken as if unclamped).
    mean_d_p = a / s_x
    tl.store(kl_ptr + row, tl.maximum(0.5 * (mean_d_p - b / s_y), 0.0))
    # 4. For the backward: stats (5, N) = max x, log-sum x, max y, log-sum y, E_p[d] (lse kept in two
    #    parts for precision, see _utils).
    tl.store(stats_ptr + row, m_x)
    tl.store(stats_ptr + n_rows + row, tl.log(s_x))
    tl.store(stats_ptr + 2 * n_rows + row, m_y)
    tl.store(stats_ptr + 3 * n_rows + row, tl.log(s_y))
    tl.store(stats_ptr + 4 * n_rows + row, mean_d_p)


# From d p_v / d x_k = p_v ([v == k] - p_k): dJ/dx_k = 1/2 (p_k (d_k - E_p[d] + 1) - q_k), d/d logits_k = dJ/dx_k / T;
# p and q are rebuilt from the saved log-sum-exps and E_p[d].
@triton.jit
def _symkl_bwd_kernel(
    x_ptr, x_row_stride, y_ptr, y_row_stride, grad_x_ptr, grad_row_stride, grad_kl_ptr,
    stats_ptr, n_rows, n_cols, inv_temperature, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # 1. Per-row scalars: 1/2 and 1/T fold into the incoming gradient.
    g = tl.load(grad_kl_ptr + row) * 0.5 * inv_temperature
    m_x = tl.load(stats_ptr + row)
    log_s_x = tl.load(stats_ptr + n_rows + row)
    m_y = tl.load(stats_ptr + 2 * n_rows + row)
    log_s_y = tl.load(stats_ptr + 3 * n_rows + row)
    mean_d_p = tl.load(stats_ptr + 4 * n_rows + row)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * y_row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        x = x * inv_temperature
        y = y * inv_temperature
        # 2. Rebuild p and q; dJ/dx_k as above the kernel.
        p = tl.exp((x - m_x) - log_s_x)
        q = tl.exp((y - m_y) - log_s_y)
        grad = g * (tl.where(p > 0, p * (x - y - mean_d_p + 1.0), 0.0) - q)
        tl.store(grad_x_ptr + row * grad_row_stride + cols, grad.to(grad_x_ptr.dtype.element_ty), mask=cols < n_cols)


def symkl_forward(logits, ref_logits, temperature):
    """Launch the forward: (N, V) x2 with unit column stride -> kl (N,), stats (5, N) for the backward; fp32."""
    n_rows, n_cols = logits.shape
    kl = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    stats = torch.empty(5, n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _symkl_fwd_kernel[(n_rows,)](logits, logits.stride(0), ref_logits, ref_logits.stride(0), kl, stats,
                                     n_rows, n_cols, 1.0 / temperature, **vocab_meta(n_cols))
    return kl, stats


def symkl_backward(logits, ref_logits, stats, grad_kl, temperature):
    """Launch the backward -> grad w.r.t. logits (N, V) in the logits' dtype."""
    n_rows, n_cols = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n_rows:
        _symkl_bwd_kernel[(n_rows,)](logits, logits.stride(0), ref_logits, ref_logits.stride(0), grad, grad.stride(0),
                                     grad_kl.float().contiguous(), stats, n_rows, n_cols, 1.0 / temperature,
                                     **vocab_meta(n_cols))
    return grad


class SymmetricKLFunction(torch.autograd.Function):
    """Autograd wrapper: saves both logits and five (N,) vectors; no gradient to the reference."""

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature):
        kl, stats = symkl_forward(logits, ref_logits, temperature)
        ctx.save_for_backward(logits, ref_logits, stats)
        ctx.temperature = temperature
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        logits, ref_logits, stats = ctx.saved_tensors
        return symkl_backward(logits, ref_logits, stats, grad_kl, ctx.temperature), None, None


def full_symmetric_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-row 1/2 (KL(p||q) + KL(q||p)) (N,) float32 of (N, V) logits and constant ref_logits, one Triton pass."""
    check_float_2d("logits", logits)
    check_float_2d("ref_logits", ref_logits, logits.shape[0])
    if ref_logits.shape != logits.shape:
        raise ValueError(f"ref_logits must have the logits' shape {tuple(logits.shape)}, got {tuple(ref_logits.shape)}")
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits must be on the logits' device {logits.device}, got {ref_logits.device}")
    temperature = check_temperature(temperature)
    check_runnable(logits, "full_symmetric_kl")
    return SymmetricKLFunction.apply(unit_col_stride(logits), unit_col_stride(ref_logits.detach()), temperature)
