"""Attention over a packed row (``verl_ds.packing``) without the O(N^2) mask: ``verl_ds_varlen_sdpa``.

How transformers 5.24 keeps packed sequences apart (``transformers/masking_utils.py``): with
``attention_mask=None``, no cache and ``position_ids`` given, ``_preprocess_mask_arguments`` calls
``find_packed_sequence_indices(position_ids)``, which starts a new sequence wherever a position id
is not the previous one plus 1; ``create_causal_mask`` then ANDs ``packed_sequence_mask_function``
into the causal mask (after ``remap_positions_for_packed_sequence``). For ``eager`` and ``sdpa`` that
builds a dense (1, 1, N, N) block-diagonal bool mask: correct, but attention costs O(N^2) over the
whole packed row instead of the sum of the squared sequence lengths. ``flash_attention_2/3`` get no
mask; ``modeling_flash_attention_utils._flash_attention_forward`` runs ``flash_attn_varlen_func`` on
the ``cu_seq_lens_q/k`` kwargs (or, without them, on bounds from ``prepare_fa_kwargs_from_position_ids``).
On GPUs with flash-attn installed use ``flash_attention_2`` for packed rows.

Where flash-attn is unavailable (CPUs), ``use_varlen_attention(model)`` switches a model to the
attention implementation registered here: the same ``sdpa_attention_forward`` transformers uses,
run on each sequence of a packed row (bounds from the ``cu_seq_lens_q`` kwarg that
``Packed.attention_kwargs()`` supplies, else from ``position_ids`` by transformers' rule), and its mask
function skips the dense mask for a packed row. Padded batches (an attention mask given) take the
plain sdpa path with sdpa's mask, unchanged. Sliding-window layers (Qwen2 ``use_sliding_window``) get
a per-sequence window mask. A row packed with shared prompts (``verl_ds.prompt_sharing``, its layout in the
``verl_ds_prompt_groups`` keyword) is attended block by block (runs of whole groups up to
``prompt_sharing.BLOCK_TOKENS`` tokens, one sdpa call each), or as one batch of its groups padded to the longest
(one sdpa call) where that scores fewer pairs: each prompt causally, its responses seeing the whole prompt and
their own earlier tokens.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verl_ds.models.base import unwrap_module
from verl_ds.prompt_sharing import PROMPT_GROUPS_KWARG

__all__ = ["VARLEN_ATTENTION", "BATCH_MIN_SAVED_MACS", "varlen_sdpa_attention", "register_varlen_attention",
           "use_varlen_attention", "sequence_bounds", "PackedRowNotReached", "packed_row_witness", "family_name"]

VARLEN_ATTENTION = "verl_ds_varlen_sdpa"
# a shared-prompt row is attended as one padded batch of its groups when that saves at least this many multiply-adds
# per score product (fewer pairs x heads x head_dim) over its block masks: below it the batch's four gathers cost
# more than they save (the default tiny model, 4 heads of 16, stepped 5% slower with them)
BATCH_MIN_SAVED_MACS = 1 << 22


# Without autograd, a CPU attention call with at most this many scores (batch x heads x queries x keys) is computed
# as two products and a softmax instead of sdpa's flash kernel, whose fixed cost dominates such calls. Inside the
# 30M-parameter GRPO step of benchmarks/e2e_vs_trl.py (each call timed both ways in turn): decoding steps (128 rows x
# 8 heads x 1 query x 10-16 keys) 1.15-1.25x faster on 1 thread and 2.5-3x on 2; the log-prob passes' batches of
# shared-prompt groups (16 x 8 x 37 x 37 scores) 8% slower on 1 thread and 1.4x faster on 2, so they stay on flash.
# Anything with autograd keeps sdpa: with its backward, flash was 2x faster on 2 threads and within 7% on 1 (alone).
EXPLICIT_MAX_SCORES = 1 << 16


def sequence_bounds(cu_seqlens: torch.Tensor | None, position_ids: torch.Tensor | None, n: int) -> list[int] | None:
    """Start offsets of the sequences of a packed row plus its end [0, ..., n], from ``cu_seqlens`` or
    else from ``position_ids`` (a new sequence wherever a position is not the previous plus 1, as
    transformers' ``find_packed_sequence_indices``); None when neither is given."""
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != n or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seq_lens_q must ascend from 0 to the packed length {n}, got {bounds[:8]}...")
        return bounds
    if position_ids is None:
        return None
    pos = position_ids.reshape(-1)
    if pos.numel() != n:
        return None
    starts = (torch.diff(pos) != 1).nonzero().flatten().add_(1).tolist()
    return [0, *starts, n]


class PackedRowNotReached(ValueError):
    """A packed forward whose attention calls did not all get what keeps its sequences apart (the layout or the
    sequence bounds): its numbers would be silently wrong, so they are refused."""


class _Witness:
    """What the attention calls of one packed forward received (``packed_row_witness``)."""

    def __init__(self, tokens: int, layout: Any):
        self.tokens, self.layout = tokens, layout
        self.calls, self.missed, self.not_causal = 0, [], []

    def record(self, module, query, key, attention_mask, groups, kwargs) -> None:
        self.calls += 1
        n = self.tokens
        whole_row = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2] == n
        if self.layout is not None:
            ok = whole_row and groups is self.layout
        else:
            pos = kwargs.get("position_ids")
            ok = whole_row and (kwargs.get("cu_seq_lens_q") is not None
                                or (isinstance(pos, torch.Tensor) and pos.numel() == n))
        if not ok:
            self.missed.append(type(module).__name__)
        if getattr(module, "is_causal", True) is False:
            self.not_causal.append(type(module).__name__)


_WITNESS: contextvars.ContextVar = contextvars.ContextVar("verl_ds_packed_row_witness", default=None)


def _config(model: Any):
    inner = unwrap_module(model)
    return getattr(inner, "config", None) or getattr(getattr(inner, "backbone", None), "config", None)


def family_name(model: Any) -> str:
    """``model_type (ClassName)`` of a HF model (or a DeepSpeed engine / CriticLM around one), for messages."""
    return f"{getattr(_config(model), 'model_type', None) or '?'} ({type(unwrap_module(model)).__name__})"


def text_config(model: Any):
    """The text part of ``model``'s config (a multimodal config's language model's, else the config itself)."""
    cfg = _config(model)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def expected_attention_calls(model: Any) -> int | None:
    """Attention calls one forward of ``model`` makes, one per decoder layer (the text config's
    ``num_hidden_layers``); None when the config does not say."""
    n = getattr(text_config(model), "num_hidden_layers", None)
    return n if isinstance(n, int) and n > 0 else None


@contextlib.contextmanager
def packed_row_witness(model: Any, tokens: int, layout: Any = None):
    """Around one forward of ``model`` over a packed row of ``tokens`` tokens (``layout``: its shared-prompt
    ``PromptGroups``, else plain packing): every attention call must go through ``verl_ds_varlen_sdpa`` with the whole
    row, no mask, and the layout (or the sequence bounds: ``cu_seq_lens_q`` or ``position_ids``), be causal, and there
    must be at least one per decoder layer (fewer: other layers mix tokens outside attention, e.g. state-space or
    linear-attention layers, across the packed sequences). Otherwise ``PackedRowNotReached`` names the family, after the
    forward. A model that does not pass its decoder layer's keyword arguments on to its attention (StableLM, Nemotron in
    transformers 5.24) loses the layout on the way: without this check its shared rows would be attended as if each
    response started a new sequence. Plain packing on another attention implementation (sdpa, flash-attention) is not
    witnessed: transformers keeps those rows apart by their position ids."""
    if layout is None and getattr(_config(model), "_attn_implementation", None) != VARLEN_ATTENTION:
        yield None  # plain packing on transformers' own attention: its packed-row mask from the position ids
        return
    witness = _Witness(tokens, layout)
    token = _WITNESS.set(witness)
    try:
        yield witness
    finally:
        _WITNESS.reset(token)
    what = "shared prompts" if layout is not None else "packed rows"
    fix = "model.share_prompts=false" if layout is not None else "model.remove_padding=false"
    family = family_name(model)
    if not witness.calls:
        raise PackedRowNotReached(f"{what}: {family}: no attention call went through {VARLEN_ATTENTION} (no attention "
                                  f"layer, or its own attention code): nothing keeps the packed sequences apart; set "
                                  f"{fix}")
    if witness.missed:
        got = "the shared-prompt layout" if layout is not None else "the sequence bounds"
        raise PackedRowNotReached(f"{what}: {family}: {got} did not reach {len(witness.missed)} of its "
                                  f"{witness.calls} attention calls ({witness.missed[0]}: its layers do not pass "
                                  f"keyword arguments on to the attention, or it masks the row itself); its numbers "
                                  f"would be wrong: set {fix}")
    if witness.not_causal:
        raise PackedRowNotReached(f"{what}: {family}: its attention ({witness.not_causal[0]}) is not causal (an "
                                  f"encoder, or a decoder config with is_decoder=false); set {fix}")
    expected = expected_attention_calls(model)
    if expected is not None and witness.calls < expected:  # differential attention calls it twice a layer
        raise PackedRowNotReached(f"{what}: {family}: {witness.calls} attention calls for {expected} layers: the other "
                                  f"layers mix tokens outside attention (state-space, convolution or linear-attention "
                                  f"layers), across the packed sequences; set {fix}")


def _window_mask(length: int, window: int, device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d < window)).view(1, 1, length, length)  # causal, at most window - 1 back


def varlen_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any):
    """transformers attention function: query (1, heads, N, d), key/value (1, kv_heads, N, d) of a packed
    row -> ((1, N, heads, d), None), sdpa run per sequence; anything else goes to sdpa unchanged."""
    packed_row = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2] > 1
    window = kwargs.get("sliding_window")
    groups = kwargs.pop(PROMPT_GROUPS_KWARG, None)
    witness = _WITNESS.get()
    if witness is not None:
        witness.record(module, query, key, attention_mask, groups, kwargs)
    if groups is not None and packed_row:
        if window and window < groups.longest:  # a window that covers every sequence changes nothing
            raise ValueError(f"{PROMPT_GROUPS_KWARG}: shared prompts need full attention; this layer has a sliding "
                             f"window of {window} tokens and the row a sequence of {groups.longest} (set "
                             f"model.share_prompts=false)")
        return _shared_prompt_attention(module, query, key, value, groups, dropout, scaling, kwargs), None
    bounds = None
    if packed_row:  # no position ids either: one sequence (a sliding window still needs its mask here)
        n = query.shape[2]
        bounds = sequence_bounds(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), n) or [0, n]
    if bounds is None or (len(bounds) == 2 and not window):
        return _attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    kw = {k: v for k, v in kwargs.items() if k != "is_causal"}
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        seg_mask = _window_mask(e - s, window, query.device) if window and e - s > window else None
        out, _ = _attend(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], seg_mask, dropout=dropout,
                         scaling=scaling, is_causal=seg_mask is None, **kw)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _attend(module, query, key, value, mask, dropout: float = 0.0, scaling: float | None = None,
            is_causal: bool | None = None, **kwargs):
    """``sdpa_attention_forward``'s contract ((B, heads, Lq, d) query, (B, kv_heads, Lk, d) key/value, a bool
    "may attend" or an additive float mask -> ((B, Lq, heads, d), None)); small calls without autograd on a CPU
    are computed explicitly (``EXPLICIT_MAX_SCORES``), everything else by sdpa."""
    B, H, Lq, D = query.shape
    Lk = key.shape[2]
    explicit = (query.device.type == "cpu" and B * H * Lq * Lk <= EXPLICIT_MAX_SCORES and dropout == 0.0
                and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                                      or value.requires_grad))
                and (mask is not None or Lq == 1 or is_causal is False)
                and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)
    if not explicit:
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return _explicit_attention(query, key, value, mask, D ** -0.5 if scaling is None else scaling), None


def _explicit_attention(query, key, value, mask, scaling: float) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v as sdpa computes it, with the query heads of one key/value head folded into
    its rows (no repeated keys); a bool mask's fully masked rows give 0, as sdpa's. -> (B, Lq, heads, dv), dv the
    value head size (DeepSeek-V2/V3's MLA: not the query's)."""
    B, H, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    g = H // Hkv
    scores = torch.matmul(query.reshape(B, Hkv, g * Lq, D), key.transpose(-1, -2)).mul_(scaling)
    grouped = scores.view(B, Hkv, g, Lq, Lk)
    if mask is not None and mask.dtype == torch.bool:
        keep = mask.unsqueeze(2)  # (B or 1, 1 or heads, Lq, Lk) -> broadcast over the folded heads
        if keep.shape[1] != 1:
            keep = keep.reshape(keep.shape[0], Hkv, g, Lq, Lk)
        grouped.masked_fill_(~keep, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        probs.view(B, Hkv, g, Lq, Lk).masked_fill_(~keep, 0.0)  # a row with no key left: 0, not a uniform mean
    else:
        if mask is not None:
            m = mask.unsqueeze(2)
            grouped.add_(m if m.shape[1] == 1 else m.reshape(m.shape[0], Hkv, g, Lq, Lk))
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value)  # (B, Hkv, g * Lq, dv): MLA's value heads may be narrower than its query heads
    return out.view(B, H, Lq, value.shape[-1]).transpose(1, 2).contiguous()


def _shared_prompt_attention(module, query, key, value, layout, dropout, scaling, kwargs) -> torch.Tensor:
    """Attention over a ``verl_ds.prompt_sharing`` row (``layout``: its ``PromptGroups``): each prompt causal on
    itself, its responses seeing the whole prompt and their own earlier tokens, no token seeing another group. One
    sdpa call over the groups padded to a batch (``layout.batched``) when that saves ``BATCH_MIN_SAVED_MACS``, else
    one per block of consecutive groups with the block's mask."""
    kw = {k: v for k, v in kwargs.items() if k != "is_causal"}
    saved = layout.saved_pairs * query.shape[1] * query.shape[3]  # the batch is built only if it is to be used
    if saved >= BATCH_MIN_SAVED_MACS and layout.batched is not None:
        return _batched_group_attention(module, query, key, value, layout.batched, dropout, scaling, kw)
    outs = []
    for start, end, mask in layout.blocks:
        whole = start == 0 and end == query.shape[2]
        q, k, v = (query, key, value) if whole else (query[:, :, start:end], key[:, :, start:end], value[:, :, start:end])
        out, _ = _attend(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=False, **kw)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _batched_group_attention(module, query, key, value, batch, dropout, scaling, kw) -> torch.Tensor:
    """(1, heads, N, d) packed query/key/value -> (1, N, heads, d): the row's groups gathered into (G, heads, L, d)
    (``prompt_sharing.GroupBatch``), attended in one call with the (G, 1, L, L) mask, the real slots read back."""
    G, L = batch.mask.shape[0], batch.mask.shape[-1]

    def gather(t: torch.Tensor) -> torch.Tensor:  # (1, h, N, d) -> (G, h, L, d)
        return t.index_select(2, batch.index).view(t.shape[1], G, L, t.shape[3]).transpose(0, 1)

    out, _ = _attend(module, gather(query), gather(key), gather(value), batch.mask, dropout=dropout, scaling=scaling,
                     is_causal=False, **kw)  # (G, L, heads, d)
    return out.reshape(1, G * L, *out.shape[2:]).index_select(1, batch.valid)


def _varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None,
                 **kwargs):
    """sdpa's mask, except None for one unpadded row without a cache (a packed row): the attention
    function then splits it into its sequences instead of reading an (N, N) mask."""
    no_offset = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    if attention_mask is None and batch_size == 1 and q_length == kv_length and no_offset:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> str:
    """Register ``verl_ds_varlen_sdpa`` with transformers' attention and mask interfaces (idempotent);
    returns the name, for ``from_config(..., attn_implementation=name)``."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
    return VARLEN_ATTENTION


def use_varlen_attention(model: Any) -> Any:
    """Switch a HF model (or a CriticLM / DeepSpeed engine around one) to ``verl_ds_varlen_sdpa``; returns
    ``model``. Padded inputs keep sdpa's numbers; packed rows are attended per sequence."""
    name = register_varlen_attention()
    inner = unwrap_module(model)
    targets = [inner] if hasattr(inner, "set_attn_implementation") else [
        m for m in inner.children() if hasattr(m, "set_attn_implementation")]
    if not targets:
        raise TypeError(f"use_varlen_attention: {type(inner).__name__} is not a transformers model and has no "
                        f"transformers model as a direct child (e.g. CriticLM.backbone)")
    for m in targets:
        m.set_attn_implementation(name)
        if m.config._attn_implementation != name:
            raise ValueError(f"use_varlen_attention: {type(m).__name__} kept attention "
                             f"{m.config._attn_implementation!r}: it does not dispatch through transformers' "
                             f"AttentionInterface, so packed rows would need a dense mask")
    return model
