"""Fused log-prob + entropy of the chosen tokens from (N, V) logits in one read (torch twin:
``verl_ds.algos.logprob.logprobs_and_entropy_torch``). Nothing (N, V) is kept: the backward re-reads the logits and
rebuilds p from each row's saved max and log-sum. Rows labelled ``ignore_index`` stream no column and get 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (check_float_2d, check_labels, check_runnable, check_temperature, row_softmax_stats,
                     unit_col_stride, vocab_meta)


@triton.jit
def row_logprob_entropy(logits_ptr, logits_row_stride, labels_ptr, row, n_cols, inv_temperature, ignore_index,
                        WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row ``row``'s (active, logprob, entropy, max, log-sum) in fp32; all but ``active`` are 0 on an ignored row."""
    row_ptr = logits_ptr + row * logits_row_stride
    # 1. An ignored row streams zero columns.
    label = tl.load(labels_ptr + row)
    active = label != ignore_index
    m, log_s, entropy = row_softmax_stats(row_ptr, tl.where(active, n_cols, 0), inv_temperature, WITH_ENTROPY,
                                          BLOCK_V)
    # 2. The target logit: one scalar load. An out-of-range label (only checkable on the host
    #    with a sync on CUDA) gives NaN rather than reading another row.
    in_range = (label >= 0) & (label < n_cols)
    x_y = tl.load(row_ptr + label, mask=active & in_range).to(tl.float32) * inv_temperature
    # 3. x_y <= max and log s >= 0 hold exactly, but a log-prob above 0 is a probability above 1
    #    (a peer's kernel shipped that: verl #2656), so clamp any rounding; likewise the entropy at
    #    0. The gradients are taken as if unclamped.
    logprob = tl.where(in_range, tl.minimum((x_y - m) - log_s, 0.0), float("nan"))
    return (active, tl.where(active, logprob, 0.0), tl.where(active, tl.maximum(entropy, 0.0), 0.0),
            tl.where(active, m, 0.0), tl.where(active, log_s, 0.0))


@triton.jit
def _logprob_entropy_fwd_kernel(
    logits_ptr, logits_row_stride, labels_ptr, logprob_ptr, entropy_ptr, max_ptr, log_sum_ptr,
    n_cols, inv_temperature, ignore_index,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # int64: row * stride overflows int32 for N * V > 2^31 (16384 x 151936 is 2.5e9)
    row = tl.program_id(0).to(tl.int64)
    _, logprob, entropy, m, log_s = row_logprob_entropy(logits_ptr, logits_row_stride, labels_ptr, row, n_cols,
                                                        inv_temperature, ignore_index, WITH_ENTROPY, BLOCK_V)
    tl.store(logprob_ptr + row, logprob)
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


# With x = logits / T and E_p[x] = lse - H: d logprob / d x_k = [k == y] - p_k and d entropy / d x_k = -p_k (x_k -
# E_p[x]) = -p_k (log p_k + H), so d / d logits_k = (g_l ([k == y] - p_k) - g_H p_k (log p_k + H)) / T.
@triton.jit
def _logprob_entropy_bwd_kernel(
    logits_ptr, logits_row_stride, grad_logits_ptr, grad_row_stride, labels_ptr, max_ptr, log_sum_ptr, entropy_ptr,
    grad_logprob_ptr, grad_entropy_ptr, n_cols, inv_temperature, ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    active = label != ignore_index
    # 1. Per-row scalars; an ignored row gets zero coefficients and masked (free) loads, so it only
    #    writes its zero gradient.
    m = tl.load(max_ptr + row)
    log_s = tl.load(log_sum_ptr + row)
    g_lp = tl.where(active, tl.load(grad_logprob_ptr + row), 0.0) * inv_temperature
    if HAS_GRAD_ENTROPY:
        g_h = tl.where(active, tl.load(grad_entropy_ptr + row), 0.0) * inv_temperature
        entropy = tl.load(entropy_ptr + row)
    n_read = tl.where(active, n_cols, 0)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        # 2. Rebuild log p from the saved max and log-sum (no softmax was stored).
        x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=cols < n_read, other=0.0)
        log_p = (x.to(tl.float32) * inv_temperature - m) - log_s
        p = tl.exp(log_p)
        # 3. The formula above the kernel.
        grad = g_lp * (tl.where(cols == label, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # p == 0 (a -inf logit, masked vocabulary) must give 0, not 0 * -inf
            grad -= g_h * tl.where(p > 0, p * (log_p + entropy), 0.0)
        tl.store(grad_logits_ptr + row * grad_row_stride + cols, grad.to(grad_logits_ptr.dtype.element_ty),
                 mask=cols < n_cols)


def logprob_entropy_forward(logits, labels, temperature, with_entropy, ignore_index):
    """Launch the forward: (N, V) logits -> logprob, entropy or None, stats (2, N) of row max and log-sum; fp32."""
    n_rows, n_cols = logits.shape
    logprob = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    stats = torch.empty(2, n_rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprob) if with_entropy else None
    if n_rows:
        _logprob_entropy_fwd_kernel[(n_rows,)](
            logits, logits.stride(0), labels, logprob, entropy if with_entropy else logprob, stats[0], stats[1],
            n_cols, 1.0 / temperature, ignore_index, WITH_ENTROPY=with_entropy, **vocab_meta(n_cols))
    return logprob, entropy, stats


def logprob_entropy_backward(logits, labels, stats, entropy, grad_logprob, grad_entropy, temperature, ignore_index):
    """Launch the backward -> grad_logits (N, V) in the logits' dtype. ``grad_entropy`` may be None."""
    n_rows, n_cols = logits.shape
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if grad_logprob is None:
        grad_logprob = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    has_grad_entropy = grad_entropy is not None
    if n_rows:
        _logprob_entropy_bwd_kernel[(n_rows,)](
            logits, logits.stride(0), grad_logits, grad_logits.stride(0), labels, stats[0], stats[1],
            entropy if has_grad_entropy else stats, grad_logprob.float().contiguous(),
            grad_entropy.float().contiguous() if has_grad_entropy else stats,
            n_cols, 1.0 / temperature, ignore_index, HAS_GRAD_ENTROPY=has_grad_entropy, **vocab_meta(n_cols))
    return grad_logits


class LogprobEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: saves logits, labels, the row stats and the entropy (O(N) beyond the inputs)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, compute_entropy, ignore_index):
        logprob, entropy, stats = logprob_entropy_forward(logits, labels, temperature, compute_entropy, ignore_index)
        ctx.save_for_backward(logits, labels, stats, entropy if compute_entropy else stats)
        ctx.temperature, ctx.ignore_index, ctx.compute_entropy = temperature, ignore_index, compute_entropy
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, labels, stats, entropy = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None
        grad_entropy = grad_entropy if ctx.compute_entropy else None
        grad_logits = logprob_entropy_backward(logits, labels, stats, entropy, grad_logprob, grad_entropy,
                                               ctx.temperature, ctx.ignore_index)
        return grad_logits, None, None, None, None


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         compute_entropy: bool = True, ignore_index: int = -100):
    """(logprob (N,) float32 <= 0, entropy (N,) float32 >= 0 or None) of ``labels`` (N,) under softmax(logits /
    temperature) of (N, V) logits, fused in Triton, differentiable; 0 on rows labelled ``ignore_index``."""
    check_float_2d("logits", logits)
    check_labels(labels, logits.shape[0], logits.shape[1], ignore_index)
    temperature = check_temperature(temperature)
    if labels.device != logits.device:
        raise ValueError(f"labels must be on the logits' device {logits.device}, got {labels.device}")
    check_runnable(logits, "logprobs_and_entropy")
    return LogprobEntropyFunction.apply(unit_col_stride(logits), labels.contiguous(), temperature,
                                        bool(compute_entropy), int(ignore_index))
