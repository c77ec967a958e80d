"""Token log-probs and entropy of softmax(logits / temperature) in one pass over the vocabulary, walking the (N, V)
rows in cache-sized chunks: no second logits-sized tensor, only fp32 scratch chunks and O(N) row statistics. Base 2,
as exp2 is cheaper than exp at the same accuracy; the formulas are on ``_LogProbEntropy``.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_float_tensor, check_positive_number, check_tensor
from ._chunks import as_row_blocks, chunk_plan, chunk_rows_of

# 256K fp32 elements (1 MiB) per scratch chunk on CPUs: the chunks stay in L2/L3 and
# the Python loop costs a few % (1024 chunks for 8192x32000). GPUs (the Triton-less fallback) want big ones.
CPU_CHUNK_ELEMS = 1 << 18
CUDA_CHUNK_ELEMS = 1 << 24
_LN2 = math.log(2.0)
# 2^y underflows to 0 in fp32 far above this; clamping shifted logits here keeps 0 * (-inf) (a masked
# vocabulary entry) out of the entropy gradient, and changes nothing else. (The forward uses nansum
# for the same reason: a NaN logit still shows, through the shift and ln s.)
_NEG_FLOOR = -1.0e4


def rows_per_chunk(n_cols: int, device: torch.device, chunk_rows: int | None = None) -> int:
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        return chunk_rows
    elems = CUDA_CHUNK_ELEMS if device.type == "cuda" else CPU_CHUNK_ELEMS
    return max(1, elems // max(1, n_cols))


class _LogProbEntropy(torch.autograd.Function):
    """(logits (N, V) or (B, T, V), labels or None) -> (logprob, entropy), flat (N,) float32 (empty if not asked).
    With k = log2(e) / t, y = k z, a row shift S, e_v = 2^(y_v - S) and s = sum e: log p_y = ln2 (y_y - S) - ln s,
    H = ln s - ln2 sum e (y - S) / s. S is the row max for the entropy, else y_y itself (no max pass, log p_y = -ln s
    exactly; a row whose s overflows, a logit ~88/t above the label's, is redone with its max). The backward
    recomputes e per chunk: d log p_y / dz_v = (1[v = y] - p_v) / t, dH / dz_v = -p_v (log p_v + H) / t."""

    @staticmethod
    def forward(ctx, logits, labels, inv_t: float, want_ent: bool, chunk_rows: int):
        v = logits.shape[-1]
        n = logits.numel() // v
        dev = logits.device
        f32 = torch.float32
        k = inv_t / _LN2
        rows = min(chunk_rows, max(logits.shape[-2], 1))
        chunks = chunk_plan(logits, rows)
        label_shift = labels is not None and not want_ent
        if label_shift:
            shift = logits.gather(-1, labels.unsqueeze(-1)).reshape(-1).to(f32).mul_(k)  # S = y_y
            neg_shift = shift.neg().unsqueeze(1)  # (N, 1)
        else:
            shift = torch.empty(n, dtype=f32, device=dev)
        ssum = torch.empty(n, dtype=f32, device=dev)
        dot = torch.empty(n if want_ent else 0, dtype=f32, device=dev)  # sum_v e_v (y_v - S)

        def stats(c, f0, w, e, use_max):
            r = c.shape[0]
            if use_max:
                m = c.amax(dim=1, keepdim=True).to(f32).mul_(k)  # (r, 1)
                shift[f0:f0 + r] = m.squeeze(1)
                neg = m.neg_()
            else:
                neg = neg_shift[f0:f0 + r]
            torch.add(neg, c, alpha=k, out=w)  # w = y - S in one fused multiply-add (bf16 promoted)
            if want_ent:
                torch.exp2(w, out=e)
                torch.sum(e, dim=1, out=ssum[f0:f0 + r])
                torch.nansum(e.mul_(w), dim=1, out=dot[f0:f0 + r])
            else:
                torch.sum(w.exp2_(), dim=1, out=ssum[f0:f0 + r])

        wbuf = torch.empty(rows, v, dtype=f32, device=dev)
        ebuf = torch.empty_like(wbuf) if want_ent else wbuf
        for chunk in chunks:
            r = chunk[2] - chunk[1]
            stats(chunk_rows_of(logits, chunk), chunk[3], wbuf[:r], ebuf[:r], not label_shift)
        if label_shift:
            redo = torch.nonzero(~torch.isfinite(ssum)).flatten().tolist()  # rare; one sync
            if redo:
                flat = logits.reshape(-1, v)  # a view unless (B, T, V) blocks; only these rows are read
                wbuf = torch.empty(1, v, dtype=f32, device=dev)
                for i in redo:
                    stats(flat[i:i + 1], i, wbuf, wbuf, True)
        log_s = ssum.log()
        ent = log_s - _LN2 * dot / ssum if want_ent else dot
        if labels is not None:
            # float64 keeps ln2 (y_y - S) - ln s as exact as the inputs allow (O(N) work); k rounded to
            # fp32 as the fused multiply-adds above used it
            k32 = float(torch.tensor(k, dtype=f32))
            yy = logits.gather(-1, labels.unsqueeze(-1)).reshape(-1).to(torch.float64) * k32
            lp = (_LN2 * (yy - shift.double()) - log_s.double()).to(f32)
        else:
            lp = torch.empty(0, dtype=f32, device=dev)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels if labels is not None else torch.empty(0, dtype=torch.long),
                              shift, log_s, ent)
        ctx.inv_t, ctx.rows = inv_t, rows
        ctx.has_labels, ctx.want_ent = labels is not None, want_ent
        if labels is None:
            ctx.mark_non_differentiable(lp)
        if not want_ent:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        logits, labels, shift, log_s, ent = ctx.saved_tensors
        if not ctx.has_labels:
            g_lp = None
        if not ctx.want_ent:
            g_ent = None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        inv_t, rows = ctx.inv_t, ctx.rows
        k = inv_t / _LN2
        v = logits.shape[-1]
        dev = logits.device
        inv_ts = inv_t / log_s.exp()  # p_v / t = e_v / (t s)
        g_lp32 = g_lp.to(torch.float32) if g_lp is not None else torch.zeros_like(log_s)
        if g_ent is not None:
            # -(p/t)(g_lp + g_H (log p + H)) = e * (a w + b) with log p = ln2 w - ln s, w = y - S
            g_h = g_ent.to(torch.float32)
            a = -_LN2 * g_h * inv_ts
            b = -(g_lp32 + g_h * (ent - log_s)) * inv_ts
        else:
            a = None
            b = -g_lp32 * inv_ts
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=dev)
        exact_out = logits.dtype == torch.float32
        label_term = g_lp32 * inv_t if g_lp is not None else None
        flat_labels = labels.reshape(-1)
        chunks = chunk_plan(logits, rows)

        wbuf = torch.empty(rows, v, dtype=torch.float32, device=dev)
        ebuf = torch.empty_like(wbuf)
        for chunk in chunks:
            c = chunk_rows_of(logits, chunk)
            r, f0 = c.shape[0], chunk[3]
            w, e = wbuf[:r], ebuf[:r]
            torch.add(shift[f0:f0 + r, None].neg(), c, alpha=k, out=w)
            torch.exp2(w, out=e)
            if a is not None:
                w.clamp_(min=_NEG_FLOOR)
                torch.addcmul(b[f0:f0 + r, None], w, a[f0:f0 + r, None], out=w)
                coef = w
            else:
                coef = b[f0:f0 + r, None]
            if exact_out:
                torch.mul(e, coef, out=chunk_rows_of(grad, chunk))
            else:
                # add the label term in fp32 before the single rounding to bf16/fp16
                torch.mul(e, coef, out=w)
                if label_term is not None:
                    w[torch.arange(r, device=dev), flat_labels[f0:f0 + r]] += label_term[f0:f0 + r]
                chunk_rows_of(grad, chunk).copy_(w)
        if exact_out and label_term is not None:
            grad.view(-1, v)[torch.arange(flat_labels.numel(), device=dev), flat_labels] += label_term
        return grad, None, None, None, None


def logprobs_and_entropy_torch(logits2d: torch.Tensor, labels: torch.Tensor | None, temperature: float = 1.0,
                               compute_entropy: bool = True, *, chunk_rows: int | None = None):
    """Torch path (no checks), flat (N,) float32 of (N, V) or (B, T, V) logits: the Triton kernels' test reference."""
    if labels is None and not compute_entropy:
        return None, None
    rows = rows_per_chunk(logits2d.shape[-1], logits2d.device, chunk_rows)
    lp, ent = _LogProbEntropy.apply(logits2d, labels, 1.0 / float(temperature), bool(compute_entropy), rows)
    return (lp if labels is not None else None), (ent if compute_entropy else None)


def _check_inputs(logits, labels, temperature):
    check_float_tensor(logits, "logits")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got shape {tuple(logits.shape)}")
    temperature = check_positive_number(temperature, "temperature")
    v = logits.shape[-1]
    if labels is not None:
        check_tensor(labels, "labels")
        if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
            raise TypeError(f"labels must be an integer (int64) tensor of token ids, got dtype {labels.dtype}")
        if labels.shape != logits.shape[:-1]:
            raise ValueError(f"shape mismatch: labels has shape {tuple(labels.shape)} but logits has shape "
                             f"{tuple(logits.shape)}; labels must have shape logits.shape[:-1] = "
                             f"{tuple(logits.shape[:-1])}")
        if labels.device != logits.device:
            raise ValueError(f"labels is on {labels.device} but logits is on {logits.device}")
        if labels.numel():
            lo, hi = int(labels.min()), int(labels.max())
            if lo < 0 or hi >= v:
                bad = lo if lo < 0 else hi
                raise ValueError(f"labels must be token ids in [0, V) = [0, {v}), got {bad}")
    rows = as_row_blocks(logits)
    if labels is not None:
        labels = labels.to(torch.int64).reshape(rows.shape[:-1])
    return rows, labels, temperature


def _dispatch(logits2d, labels, temperature, compute_entropy):
    from verl_ds.kernels import dispatch

    # the kernels take fp32/bf16/fp16; float64 logits (tests, references) stay on the torch path
    if logits2d.dtype != torch.float64 and dispatch.backend_for(logits2d) == "triton":
        from verl_ds.kernels.logprob import logprobs_and_entropy as kernel

        # the kernel takes (N, V) with a row stride; a (B, T, V) block view is flattened (a copy) for it
        flat = logits2d.reshape(-1, logits2d.shape[-1])
        kernel_labels = labels.reshape(-1) if labels is not None else torch.zeros(
            flat.shape[0], dtype=torch.int64, device=flat.device)
        lp, ent = kernel(flat, kernel_labels, temperature, compute_entropy=compute_entropy)
        return (lp if labels is not None else None), ent
    return logprobs_and_entropy_torch(logits2d, labels, temperature, compute_entropy)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) (..., V) at ``labels`` (...): (...) float32, differentiable."""
    logits2d, flat_labels, temperature = _check_inputs(logits, labels, temperature)
    lp, _ = _dispatch(logits2d, flat_labels, temperature, compute_entropy=False)
    return lp.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature): logits (..., V) -> (...) float32, differentiable."""
    logits2d, _, temperature = _check_inputs(logits, None, temperature)
    _, ent = _dispatch(logits2d, None, temperature, compute_entropy=True)
    return ent.view(logits.shape[:-1])


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """(log softmax(logits / t) at ``labels``, entropy) (...) float32 each, from one pass, differentiable."""
    logits2d, flat_labels, temperature = _check_inputs(logits, labels, temperature)
    lp, ent = _dispatch(logits2d, flat_labels, temperature, compute_entropy=True)
    return lp.view(labels.shape), ent.view(labels.shape)
