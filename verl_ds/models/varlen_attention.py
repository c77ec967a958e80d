"""The attention functions packed rows go through, and the check that every layer got the row's layout: flash varlen
on ``cu_seq_lens`` for plain packing on CUDA with flash-attn, else ``verl_ds_varlen_flex`` (FlexAttention) or
``verl_ds_varlen_sdpa`` (sdpa tree by tree, the CPU path). Which serves what: docs/models.md, "Attention".
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verl_ds.attention_layout import LAYOUT_KWARG, AttentionLayout

ULYSSES_PREFIX = "verl_ds_ulysses__"  # verl_ds.models.sequence_parallel's wrappers
from verl_ds.hf_module import config_of, family_name, text_config, unwrap_module

__all__ = ["VARLEN_ATTENTION", "FLEX_ATTENTION", "varlen_sdpa_attention", "varlen_flex_attention",
           "register_varlen_attention", "use_attention", "use_varlen_attention", "PackedRowNotReached",
           "packed_row_witness", "family_name"]

VARLEN_ATTENTION = "verl_ds_varlen_sdpa"
FLEX_ATTENTION = "verl_ds_varlen_flex"
_OURS = (VARLEN_ATTENTION, FLEX_ATTENTION)

class PackedRowNotReached(ValueError):
    """A packed forward whose attention calls did not all get the row's layout: its numbers would be wrong."""


class _Witness:
    """What the attention calls of one packed forward received (``packed_row_witness``)."""

    def __init__(self, tokens: int, layout: Any, shared: bool):
        self.tokens, self.layout, self.shared = tokens, layout, shared
        self.calls, self.missed, self.not_causal = 0, [], []

    def record(self, module, query, key, attention_mask, layout, position_ids) -> None:
        self.calls += 1
        n = self.tokens
        whole_row = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2] == n
        # plain packing may also arrive as position ids only (layers that drop keyword arguments pass those)
        bounds = layout is self.layout or (layout is None and not self.shared and isinstance(position_ids, torch.Tensor)
                                           and position_ids.numel() == n)
        if not (whole_row and bounds):
            self.missed.append(type(module).__name__)
        if getattr(module, "is_causal", True) is False:
            self.not_causal.append(type(module).__name__)


_WITNESS: contextvars.ContextVar = contextvars.ContextVar("verl_ds_packed_row_witness", default=None)


@contextlib.contextmanager
def packed_row_witness(model: Any, tokens: int, layout: AttentionLayout, shared: bool = False):
    """Around one packed forward: every attention call must get the whole row, no mask and this ``layout``, be causal
    and come once per decoder layer, else ``PackedRowNotReached`` (flash's plain packing is kept by ``cu_seq_lens``)."""
    impl = str(getattr(config_of(model), "_attn_implementation", None))
    if impl.startswith(ULYSSES_PREFIX):  # sequence parallel: the wrapper tells the witness when its kernel does not
        impl = VARLEN_ATTENTION
    if not shared and impl not in _OURS:
        yield None  # plain packing on transformers' flash varlen path
        return
    witness = _Witness(tokens, layout, shared)
    token = _WITNESS.set(witness)
    try:
        yield witness
    finally:
        _WITNESS.reset(token)
    what = "shared prompts" if shared else "packed rows"
    fix = "model.share_prompts=false" if shared else "model.remove_padding=false"
    family = family_name(model)
    if not witness.calls:
        raise PackedRowNotReached(f"{what}: {family}: no attention call went through {' or '.join(_OURS)} (no "
                                  f"attention layer, or its own attention code): nothing keeps the packed sequences "
                                  f"apart; set {fix}")
    if witness.missed:
        raise PackedRowNotReached(f"{what}: {family}: the row's layout did not reach {len(witness.missed)} of its "
                                  f"{witness.calls} attention calls ({witness.missed[0]}: its layers do not pass "
                                  f"keyword arguments on to the attention, or it masks the row itself); its numbers "
                                  f"would be wrong: set {fix}")
    if witness.not_causal:
        raise PackedRowNotReached(f"{what}: {family}: its attention ({witness.not_causal[0]}) is not causal (an "
                                  f"encoder, or a decoder config with is_decoder=false); set {fix}")
    expected = getattr(text_config(model), "num_hidden_layers", None)  # one attention call per decoder layer
    if isinstance(expected, int) and witness.calls < expected:  # differential attention calls it twice a layer
        raise PackedRowNotReached(f"{what}: {family}: {witness.calls} attention calls for {expected} layers: the other "
                                  f"layers mix tokens outside attention (state-space, convolution or linear-attention "
                                  f"layers), across the packed sequences; set {fix}")


def _row_layout(module, query, key, attention_mask, kwargs: dict) -> AttentionLayout | None:
    """The layout of a packed row (one unpadded row, no cache): the keyword's, else the sequences ``cu_seq_lens_q``
    or its position ids start (one host sync per layer, for callers that pass no layout); None for anything else."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    witness = _WITNESS.get()
    if witness is not None:
        witness.record(module, query, key, attention_mask, layout, kwargs.get("position_ids"))
    n = query.shape[2]
    if attention_mask is not None or query.shape[0] != 1 or key.shape[2] != n or n < 2:
        return None
    if layout is None:
        cu, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
        if isinstance(cu, torch.Tensor):
            bounds = cu.tolist()
        elif isinstance(pos, torch.Tensor) and pos.numel() == n:
            bounds = [0, *(torch.diff(pos.reshape(-1)) != 1).nonzero().flatten().add_(1).tolist(), n]
        else:
            return None
        if bounds[0] != 0 or bounds[-1] != n or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seq_lens_q must ascend from 0 to the packed length {n}, got {bounds[:8]}...")
        layout = AttentionLayout.sequences([e - s for s, e in zip(bounds[:-1], bounds[1:])], query.device)
    elif layout.starts[-1] != n:
        raise ValueError(f"{LAYOUT_KWARG}: a layout of {layout.starts[-1]} tokens for a row of {n}")
    return layout


def varlen_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any):
    """transformers attention function: query (1, heads, N, d), key/value (1, kv_heads, N, d) of a packed row ->
    ((1, N, heads, d), None), sdpa on each tree of its layout; anything else goes to sdpa unchanged."""
    layout = _row_layout(module, query, key, attention_mask, kwargs)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kwargs.get("sliding_window")
    kw = {k: v for k, v in kwargs.items() if k != "is_causal"}

    def sdpa(start, end, segments=1):  # one causal sequence within the window: no mask
        mask = layout.dense(start, end, window)[None, None] if segments > 1 or end - start > (window or end) else None
        whole = start == 0 and end == query.shape[2]
        q, k, v = (query, key, value) if whole else (query[:, :, start:end], key[:, :, start:end],
                                                      value[:, :, start:end])
        return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                      is_causal=mask is None, **kw)[0]

    # the branch plan's second call and gathers pay where the grid's masked score entries (4 * hidden FLOP each: QK and
    # AV) are a tenth of the arithmetic of the tree's tokens in the rest of the layer (about 24 * hidden^2 each)
    hidden = query.shape[1] * query.shape[3]
    outs = []
    for i, (start, end, segments) in enumerate(layout.trees):
        plan = layout.branches(i, window, min_saved=0.6 * (end - start) * hidden) if segments > 1 else None
        if plan is None:
            outs.append(sdpa(start, end, segments))
            continue
        root_end, q_idx, kv_idx, mask, rows = plan  # the root alone, then every other segment on its path, batched
        q, k, v = (t[0][:, idx].transpose(0, 1) for t, idx in ((query, q_idx), (key, kv_idx), (value, kv_idx)))
        out, _ = sdpa_attention_forward(module, q, k, v, mask[:, None], dropout=dropout, scaling=scaling,
                                        is_causal=False, **kw)
        outs += [sdpa(start, root_end), out.flatten(0, 1)[rows][None]]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


_COMPILED_FLEX = None


def varlen_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any):
    """transformers attention function: a packed row through FlexAttention and its layout's ``BlockMask``; else sdpa."""
    global _COMPILED_FLEX
    layout = _row_layout(module, query, key, attention_mask, kwargs)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError(f"flex_attention has no attention dropout (got {dropout}); set the model config's "
                         f"attention_dropout to 0 or model.attn_implementation=sdpa")
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if query.device.type == "cuda":  # eager flex materialises the scores; compiled it is the block-sparse kernel
        _COMPILED_FLEX = _COMPILED_FLEX or torch.compile(flex_attention)
        fn = _COMPILED_FLEX
    out = fn(query, key, value, block_mask=layout.block_mask(kwargs.get("sliding_window")), scale=scaling,
             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None,
                 **kwargs):
    """sdpa's mask, except None for one unpadded row without a cache (a packed row): the attention function then
    attends it by its layout instead of reading an (N, N) mask."""
    no_offset = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    if attention_mask is None and batch_size == 1 and q_length == kv_length and no_offset:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> str:
    """Register ours with transformers' attention and mask interfaces (idempotent); returns the sdpa one's name."""
    for name, fn in ((VARLEN_ATTENTION, varlen_sdpa_attention), (FLEX_ATTENTION, varlen_flex_attention)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, _varlen_mask)
    return VARLEN_ATTENTION


def use_attention(model: Any, name: str) -> Any:
    """Switch a HF model (or a CriticLM / engine around one) to attention ``name``; returns ``model``."""
    register_varlen_attention()
    inner = unwrap_module(model)
    targets = [inner] if hasattr(inner, "set_attn_implementation") else [
        m for m in inner.children() if hasattr(m, "set_attn_implementation")]
    if not targets:
        raise TypeError(f"use_attention: {type(inner).__name__} is not a transformers model and has no transformers "
                        f"model as a direct child (e.g. CriticLM.backbone)")
    for m in targets:
        m.set_attn_implementation(name)
        if m.config._attn_implementation != name:
            raise ValueError(f"use_attention: {type(m).__name__} kept attention {m.config._attn_implementation!r}: "
                             f"it does not dispatch through transformers' AttentionInterface, so packed rows would "
                             f"need a dense mask")
    return model


def use_varlen_attention(model: Any) -> Any:
    return use_attention(model, VARLEN_ATTENTION)
