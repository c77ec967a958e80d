"""Log-probs and entropy straight from the final hidden states and the LM-head weight, never building the (N, V)
logits (``model.fused_lm_head``): (token chunk x vocabulary chunk) tiles with an online log-sum-exp (Milakov &
Gimelshein 2018, arXiv:1805.02867) in base 2, as ``verl_ds.algos.logprob``. verl's ``FusedLinearForPPO``
(verl/utils/experimental/torch_functional.py) chunks tokens only; tiles bound both sides. A torch path, no kernel.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_float_tensor, check_positive_number, check_tensor

__all__ = ["fused_linear_logprobs", "default_chunks"]

# float32 elements per (rows x vocab) tile: 2^20 (4 MiB) on a CPU stays in a shared L3; GPUs want large ones
CPU_TILE_ELEMS = 1 << 20
CUDA_TILE_ELEMS = 1 << 24
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
# a -inf bias entry (a masked vocabulary entry) becomes this: 2^(y - m) is still exactly 0, and 0 * (y - m)
# stays 0 in the entropy sums and gradients where -inf would give NaN
_MASKED = -1.0e30


def default_chunks(n: int, v: int, device: torch.device, chunk_rows: int | None = None,
                   vocab_chunk: int | None = None) -> tuple[int, int]:
    """(chunk_rows, vocab_chunk) for n tokens and vocabulary v on ``device``; given values are checked."""
    for name, val in (("chunk_rows", chunk_rows), ("vocab_chunk", vocab_chunk)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    tile = CUDA_TILE_ELEMS if device.type == "cuda" else CPU_TILE_ELEMS
    if vocab_chunk is None:
        vocab_chunk = 2048 if device.type != "cuda" else 16384
    if chunk_rows is None:
        chunk_rows = max(1, tile // min(vocab_chunk, v))
    return min(chunk_rows, max(n, 1)), min(vocab_chunk, v)


def _tile(h, w_c, b_c, k, out32, lowp):
    """out32 <- (h @ w_c^T + b_c) * k in float32; a low-precision matmul rounds once, as the unfused logits."""
    if lowp is None:
        if b_c is None:
            return torch.addmm(out32.new_zeros(()), h, w_c.t(), beta=0.0, alpha=k, out=out32)  # input ignored
        return torch.addmm(b_c, h, w_c.t(), beta=k, alpha=k, out=out32)
    if b_c is None:
        torch.mm(h, w_c.t(), out=lowp)
    else:
        torch.addmm(b_c, h, w_c.t(), out=lowp)
    return out32.copy_(lowp).mul_(k)


def _vocab_ranges(v: int, vchunk: int) -> list[tuple[int, int]]:
    return [(c0, min(c0 + vchunk, v)) for c0 in range(0, v, vchunk)]


class _FusedLinearLogProbs(torch.autograd.Function):
    """Per tile y = (h W_c^T + b_c) log2(e) / t, running max m, s = sum 2^(y - m), d = sum 2^(y - m) (y - m):
    log p_y = ln2 (y_y - m - log2 s), H = ln2 (log2 s - d / s). The backward recomputes each tile; with w = log2 p,
    dL/dx_v = p_v (a + b w_v) + 1[v = y] g_lp / t, a = -(g_lp + g_H H) / t, b = -ln2 g_H / t, then dh += G W_c and
    dW_c += G^T h in float32. Extra memory: two or three tiles, and the backward's (N, H) float32 gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t: float, want_ent: bool, rows: int, vchunk: int,
                ignore_index: int):
        n, v = hidden.shape[0], weight.shape[0]
        dev, f32, lowdt = hidden.device, torch.float32, hidden.dtype if hidden.dtype != torch.float32 else None
        k = inv_t * _LOG2E
        valid = labels != ignore_index
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        bias_c = bias.clamp(min=_MASKED) if bias is not None else None
        m = torch.empty(n, dtype=f32, device=dev)
        s = torch.empty(n, dtype=f32, device=dev)
        d = torch.empty(n if want_ent else 0, dtype=f32, device=dev)
        yy = torch.empty(n, dtype=f32, device=dev)
        vranges = _vocab_ranges(v, vchunk)
        row_starts = list(range(0, n, rows))

        zbuf = torch.empty(rows, vchunk, dtype=f32, device=dev)
        ebuf = torch.empty_like(zbuf)
        lowp = torch.empty(rows, vchunk, dtype=lowdt, device=dev) if lowdt is not None else None
        for r0 in row_starts:
            r1 = min(r0 + rows, n)
            h, lab = hidden[r0:r1], safe[r0:r1]
            r = r1 - r0
            m_r, s_r, y_r = m[r0:r1].fill_(float("-inf")), s[r0:r1].zero_(), yy[r0:r1]
            d_r = d[r0:r1].zero_() if want_ent else None
            for c0, c1 in vranges:
                vc = c1 - c0
                y = _tile(h, weight[c0:c1], bias_c[c0:c1] if bias_c is not None else None, k, zbuf[:r, :vc],
                          lowp[:r, :vc] if lowp is not None else None)
                hit = (lab >= c0) & (lab < c1)
                picked = y.gather(1, (lab - c0).clamp(0, vc - 1).unsqueeze(1)).squeeze(1)
                torch.where(hit, picked, y_r, out=y_r)
                m_new = torch.maximum(m_r, y.amax(dim=1))
                delta = m_r - m_new  # <= 0; -inf on the first chunk, where s = d = 0
                scale = delta.exp2()
                y.sub_(m_new.unsqueeze(1))  # w = y - m_new
                e = torch.exp2(y, out=ebuf[:r, :vc])
                if want_ent:  # d' = scale (d + s delta) + sum e w; s delta is 0 * -inf on the first chunk
                    d_r.add_(torch.where(s_r > 0, s_r * delta, 0.0)).mul_(scale)
                s_r.mul_(scale).add_(e.sum(dim=1))
                if want_ent:
                    d_r.add_(e.mul_(y).sum(dim=1))
                m_r.copy_(m_new)
        log2_s = s.log2()
        lse2 = m + log2_s  # base-2 log-sum-exp of the tempered logits
        lp = torch.where(valid, _LN2 * (yy - lse2), torch.zeros_like(lse2))
        ent = _LN2 * (log2_s - d / s) if want_ent else d
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0, device=dev), safe, valid,
                              lse2, ent)
        ctx.has_bias, ctx.inv_t, ctx.want_ent, ctx.rows, ctx.vchunk = bias is not None, inv_t, want_ent, rows, vchunk
        ctx.set_materialize_grads(False)
        if not want_ent:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, valid, lse2, ent = ctx.saved_tensors
        if not ctx.want_ent:
            g_ent = None
        if g_lp is None and g_ent is None:
            return (None,) * 9
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, hdim, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
        dev, f32, dt = hidden.device, torch.float32, hidden.dtype
        lowdt = dt if dt != f32 else None
        inv_t, rows, vchunk = ctx.inv_t, ctx.rows, ctx.vchunk
        k = inv_t * _LOG2E
        zero = torch.zeros_like(lse2)
        g_lp = torch.where(valid, g_lp.to(f32), zero) if g_lp is not None else zero
        if g_ent is not None:
            g_h = g_ent.to(f32)
            a = (-(g_lp + g_h * ent) * inv_t).unsqueeze(1)
            b = (-_LN2 * inv_t * g_h).unsqueeze(1)
        else:
            a, b = (-g_lp * inv_t).unsqueeze(1), None
        label_term = g_lp * inv_t
        bias_c = bias.clamp(min=_MASKED) if ctx.has_bias else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if (need_b and ctx.has_bias) else None
        vranges = _vocab_ranges(v, vchunk)
        gh = torch.zeros(n, hdim, dtype=f32, device=dev) if need_h else None
        zbuf = torch.empty(rows, vchunk, dtype=f32, device=dev)
        cbuf = torch.empty_like(zbuf) if b is not None else None
        lowp = torch.empty(rows, vchunk, dtype=lowdt, device=dev) if lowdt is not None else None
        gw = torch.empty(vchunk, hdim, dtype=f32, device=dev) if need_w else None
        gb = torch.empty(vchunk, dtype=f32, device=dev) if grad_b is not None else None
        for c0, c1 in vranges:
            vc = c1 - c0
            w_c = weight[c0:c1]
            if gw is not None:
                gw[:vc].zero_()
            if gb is not None:
                gb[:vc].zero_()
            for r0 in range(0, n, rows):
                r1 = min(r0 + rows, n)
                r = r1 - r0
                lw = lowp[:r, :vc] if lowp is not None else None
                y = _tile(hidden[r0:r1], w_c, bias_c[c0:c1] if bias_c is not None else None, k, zbuf[:r, :vc],
                          lw)
                y.sub_(lse2[r0:r1].unsqueeze(1))  # w = log2 p
                if b is not None:
                    coef = torch.addcmul(a[r0:r1], y, b[r0:r1], out=cbuf[:r, :vc])  # a + b w
                    y.exp2_().mul_(coef)
                else:
                    y.exp2_().mul_(a[r0:r1])
                lab = labels[r0:r1]
                hit = ((lab >= c0) & (lab < c1)).nonzero().flatten()
                if hit.numel():
                    y[hit, lab[hit] - c0] += label_term[r0:r1][hit]
                g = y if lw is None else lw.copy_(y)
                if gh is not None:
                    if lw is None:
                        gh[r0:r1].addmm_(g, w_c)
                    else:
                        gh[r0:r1] += g @ w_c
                if gw is not None:
                    if lw is None:
                        gw[:vc].addmm_(g.t(), hidden[r0:r1])
                    else:
                        gw[:vc] += g.t() @ hidden[r0:r1]
                if gb is not None:
                    gb[:vc] += y.sum(dim=0)
            if grad_w is not None:
                grad_w[c0:c1].copy_(gw[:vc])
            if grad_b is not None:
                grad_b[c0:c1].copy_(gb[:vc])
        grad_h = gh.to(dt) if gh is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          temperature: float = 1.0, bias: torch.Tensor | None = None, want_entropy: bool = True, *,
                          chunk_rows: int | None = None, vocab_chunk: int | None = None, ignore_index: int = -100):
    """(log softmax(z) at ``labels``, entropy or None), z = (hidden @ weight^T + bias) / temperature, (N,) float32
    without materialising z; differentiable; a label ``ignore_index`` gets 0 and no gradient."""
    check_float_tensor(hidden, "hidden")
    check_float_tensor(weight, "weight")
    check_tensor(labels, "labels")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (N, H) and weight (V, H) with the same H, got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer (int64) tensor of token ids, got dtype {labels.dtype}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must have shape (N,) = ({hidden.shape[0]},) to match hidden, got "
                         f"{tuple(labels.shape)}")
    if bias is not None:
        check_float_tensor(bias, "bias")
        if bias.shape != weight.shape[:1] or bias.dtype != weight.dtype:
            raise ValueError(f"bias must be ({weight.shape[0]},) {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    temperature = check_positive_number(temperature, "temperature")
    labels = labels.long()
    v = weight.shape[0]
    if labels.numel():
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= v))
        if bool(bad.any()):
            raise ValueError(f"labels must be token ids in [0, V) = [0, {v}) or ignore_index={ignore_index}, got "
                             f"{int(labels[bad][0])}")
    rows, vchunk = default_chunks(hidden.shape[0], v, hidden.device, chunk_rows, vocab_chunk)
    hidden = hidden.contiguous()
    lp, ent = _FusedLinearLogProbs.apply(hidden, weight, bias, labels, 1.0 / temperature, bool(want_entropy), rows,
                                         vchunk, int(ignore_index))
    return lp, (ent if want_entropy else None)
