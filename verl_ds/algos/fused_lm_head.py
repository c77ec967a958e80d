"""Log-probs and entropy straight from the final hidden states and the LM-head weight, never building
the (N, V) logits (``model.fused_lm_head``).

The vocabulary is walked in chunks of ``vocab_chunk`` rows of the weight (outer loop: each weight
chunk is read once) and the tokens in chunks of ``chunk_rows`` (inner loop); each (rows, vocab_chunk)
tile z = hidden @ W_c^T / t (+ bias / t) updates per-token statistics with an online log-sum-exp
(Milakov & Gimelshein 2018, arXiv:1805.02867): the running max m, s = sum_v exp(z_v - m) and
d = sum_v exp(z_v - m) (z_v - m), rescaled by exp(m_old - m_new) when the max grows, and the label's
logit z_y when the label falls in the tile. Then
    log p_y = z_y - m - ln s,     H = ln s - d / s.
The backward recomputes each tile (no (N, V) tensor is saved either) and, with p_v = exp(z_v - lse),
    d log p_y / dx_v = (1[v = y] - p_v) / t,     dH / dx_v = -p_v (z_v - lse + H) / t
for the raw logits x = t z; the tile of dL/dx then gives dL/dhidden += G W_c and dL/dW_c = G^T hidden
(and dL/dbias_c = column sums of G), accumulated in float32. Peak extra memory: a few
(chunk_rows x vocab_chunk) float32 tiles, the (N, H) float32 hidden-gradient accumulator and one
(vocab_chunk x H) float32 weight-gradient chunk.

verl's ``FusedLinearForPPO`` (verl/utils/experimental/torch_functional.py) chunks over tokens only,
each chunk with full-vocabulary logits; here tiles bound both sides. This is the torch path (CPU, and
CUDA without a kernel); there is no Triton kernel for it yet: none could be run or tested on this
project's GPU-less CI.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_float_tensor, check_positive_number, check_tensor

__all__ = ["fused_linear_logprobs", "default_chunks"]

# float32 elements per (rows x vocab) tile: 2^20 (4 MiB) keeps a CPU's tiles in L2/L3; GPUs want large ones
CPU_TILE_ELEMS = 1 << 20
CUDA_TILE_ELEMS = 1 << 24
_NEG_FLOOR = -1.0e4  # keeps 0 * (-inf) out of the entropy sums for -inf logits (a masked vocabulary entry)


def default_chunks(n: int, v: int, device: torch.device, chunk_rows: int | None = None,
                   vocab_chunk: int | None = None) -> tuple[int, int]:
    """(chunk_rows, vocab_chunk) for n tokens and vocabulary v on ``device``; given values are checked."""
    for name, val in (("chunk_rows", chunk_rows), ("vocab_chunk", vocab_chunk)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    tile = CUDA_TILE_ELEMS if device.type == "cuda" else CPU_TILE_ELEMS
    if vocab_chunk is None:
        vocab_chunk = min(v, 4096 if device.type != "cuda" else 16384)
    if chunk_rows is None:
        chunk_rows = max(1, tile // vocab_chunk)
    return min(chunk_rows, max(n, 1)), min(vocab_chunk, v)


def _tile(h, w_c, b_c, inv_t, out32, scratch):
    """out32 <- (h @ w_c^T + b_c) / t in float32; low-precision matmuls round like the unfused logits."""
    if h.dtype == torch.float32:
        if b_c is None:
            torch.mm(h, w_c.t(), out=out32)
        else:
            torch.addmm(b_c, h, w_c.t(), out=out32)
    else:
        if b_c is None:
            torch.mm(h, w_c.t(), out=scratch)
        else:
            torch.addmm(b_c, h, w_c.t(), out=scratch)
        out32.copy_(scratch)
    if inv_t != 1.0:
        out32.mul_(inv_t)
    return out32


class _FusedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t: float, want_ent: bool, rows: int, vchunk: int,
                ignore_index: int):
        n, v = hidden.shape[0], weight.shape[0]
        dev, f32 = hidden.device, torch.float32
        valid = labels != ignore_index
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        m = torch.full((n,), float("-inf"), dtype=f32, device=dev)
        s = torch.zeros(n, dtype=f32, device=dev)
        d = torch.zeros(n if want_ent else 0, dtype=f32, device=dev)
        zy = torch.zeros(n, dtype=f32, device=dev)
        zbuf = torch.empty(rows, vchunk, dtype=f32, device=dev)
        ebuf = torch.empty_like(zbuf)
        lowp = torch.empty(rows, vchunk, dtype=hidden.dtype, device=dev) if hidden.dtype != f32 else None
        for c0 in range(0, v, vchunk):
            c1 = min(c0 + vchunk, v)
            w_c = weight[c0:c1]
            b_c = bias[c0:c1] if bias is not None else None
            for r0 in range(0, n, rows):
                r1 = min(r0 + rows, n)
                r, vc = r1 - r0, c1 - c0
                z = _tile(hidden[r0:r1], w_c, b_c, inv_t, zbuf[:r, :vc], lowp[:r, :vc] if lowp is not None else None)
                lab = safe[r0:r1]
                hit = (lab >= c0) & (lab < c1)
                if bool(hit.any()):
                    picked = z.gather(1, (lab - c0).clamp_(0, vc - 1).unsqueeze(1)).squeeze(1)
                    zy[r0:r1] = torch.where(hit, picked, zy[r0:r1])
                m_old = m[r0:r1]
                m_new = torch.maximum(m_old, z.amax(dim=1))
                # exp(-inf - finite) = 0 rescales the empty start; a row still all -inf keeps scale 1
                scale = torch.where(m_new == m_old, torch.ones_like(m_new), torch.exp(m_old - m_new))
                m_sub = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)  # no -inf - -inf
                z.sub_(m_sub.unsqueeze(1)).clamp_(min=_NEG_FLOOR)  # w = z - m_new
                e = torch.exp(z, out=ebuf[:r, :vc])
                s_new = s[r0:r1] * scale + e.sum(dim=1)
                if want_ent:
                    # d' = scale (d + s (m_old - m_new)) + sum e w; the empty start has s = 0
                    shift = torch.where(s[r0:r1] > 0, m_old - m_new, torch.zeros_like(m_new))
                    d[r0:r1] = scale * (d[r0:r1] + s[r0:r1] * shift) + e.mul_(z).sum(dim=1)
                s[r0:r1] = s_new
                m[r0:r1] = m_new
        log_s = s.log()
        lse = m + log_s
        lp = torch.where(valid, zy - lse, torch.zeros_like(lse))
        ent = log_s - d / s if want_ent else d
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0, device=dev), safe, valid,
                              lse, ent)
        ctx.has_bias, ctx.inv_t, ctx.want_ent, ctx.rows, ctx.vchunk = bias is not None, inv_t, want_ent, rows, vchunk
        ctx.set_materialize_grads(False)
        if not want_ent:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, valid, lse, ent = ctx.saved_tensors
        nothing = (None,) * 9
        if not ctx.want_ent:
            g_ent = None
        if g_lp is None and g_ent is None:
            return nothing
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, v = hidden.shape[0], weight.shape[0]
        dev, f32, dt = hidden.device, torch.float32, hidden.dtype
        inv_t, rows, vchunk = ctx.inv_t, ctx.rows, ctx.vchunk
        g_lp = torch.where(valid, g_lp.to(f32), torch.zeros_like(lse)) if g_lp is not None else torch.zeros_like(lse)
        # dL/dx_v = p_v (a + b w_v) + 1[v = y] g_lp / t with w = log p = z - lse, z = x / t:
        # a = -(g_lp + g_H H) / t, b = -g_H / t (see the module docstring)
        if g_ent is not None:
            g_h = g_ent.to(f32)
            a = (-(g_lp + g_h * ent) * inv_t).unsqueeze(1)
            b = (-g_h * inv_t).unsqueeze(1)
        else:
            a, b = (-g_lp * inv_t).unsqueeze(1), None
        label_term = g_lp * inv_t
        grad_h = torch.zeros(n, hidden.shape[1], dtype=f32, device=dev) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if (need_b and ctx.has_bias) else None
        zbuf = torch.empty(rows, vchunk, dtype=f32, device=dev)
        cbuf = torch.empty_like(zbuf) if b is not None else None
        lowp = torch.empty(rows, vchunk, dtype=dt, device=dev) if dt != f32 else None
        gw = torch.zeros(vchunk, weight.shape[1], dtype=f32, device=dev) if need_w else None
        gb = torch.zeros(vchunk, dtype=f32, device=dev) if grad_b is not None else None
        bias_t = bias if ctx.has_bias else None
        for c0 in range(0, v, vchunk):
            c1 = min(c0 + vchunk, v)
            vc = c1 - c0
            w_c = weight[c0:c1]
            b_c = bias_t[c0:c1] if bias_t is not None else None
            if gw is not None:
                gw[:vc].zero_()
            if gb is not None:
                gb[:vc].zero_()
            for r0 in range(0, n, rows):
                r1 = min(r0 + rows, n)
                r = r1 - r0
                lw = lowp[:r, :vc] if lowp is not None else None
                z = _tile(hidden[r0:r1], w_c, b_c, inv_t, zbuf[:r, :vc], lw)
                z.sub_(lse[r0:r1].unsqueeze(1)).clamp_(min=_NEG_FLOOR)  # w = log p
                if b is not None:
                    coef = torch.addcmul(a[r0:r1], z, b[r0:r1], out=cbuf[:r, :vc])  # a + b w, before w becomes p
                    z.exp_().mul_(coef)
                else:
                    z.exp_().mul_(a[r0:r1])
                lab = labels[r0:r1]
                hit = ((lab >= c0) & (lab < c1)).nonzero().flatten()
                if hit.numel():
                    z[hit, lab[hit] - c0] += label_term[r0:r1][hit]
                g = z
                if lw is not None:
                    g = lw.copy_(z)
                if grad_h is not None:
                    if lw is None:
                        grad_h[r0:r1].addmm_(g, w_c)
                    else:
                        grad_h[r0:r1] += g @ w_c
                if gw is not None:
                    if lw is None:
                        gw[:vc].addmm_(g.t(), hidden[r0:r1])
                    else:
                        gw[:vc] += g.t() @ hidden[r0:r1]
                if gb is not None:
                    gb[:vc] += z.sum(dim=0)
            if grad_w is not None:
                grad_w[c0:c1].copy_(gw[:vc])
            if grad_b is not None:
                grad_b[c0:c1].copy_(gb[:vc])
        if grad_h is not None:
            grad_h = grad_h.to(dt)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          temperature: float = 1.0, bias: torch.Tensor | None = None, want_entropy: bool = True, *,
                          chunk_rows: int | None = None, vocab_chunk: int | None = None, ignore_index: int = -100):
    """(log softmax(z) at ``labels``, entropy of softmax(z)), z = (hidden @ weight^T + bias) / temperature,
    without materialising z: both (N,) float32, differentiable w.r.t. hidden, weight and bias.

    hidden: (N, H) float32/bfloat16/float16; weight: (V, H) and bias: (V,) of the same dtype; labels:
    (N,) int in [0, V) or ``ignore_index`` (log-prob 0 and no gradient through it; the entropy is still
    computed). ``want_entropy=False`` skips the entropy sums and returns None for it. chunk_rows /
    vocab_chunk size the (rows x vocab) tile (defaults: ~4 MiB tiles on CPUs)."""
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
