"""Forward passes over a packed micro-batch on its N real tokens: response log-probs (and entropy) of a causal LM and
values of a critic, (B, R) as the padded paths return them. A fused LM head returns log-probs in its own module call,
so ZeRO-3's hooks gather its weight as for the plain head. ``use_cache=False``: a cache would ignore the packing.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from verl_ds.algos import logprobs_and_entropy, logprobs_from_logits
from verl_ds.algos.fused_lm_head import fused_linear_logprobs
from verl_ds.models.base import unwrap_module
from verl_ds.models.varlen_attention import packed_row_witness
from verl_ds.packing import Packed, _no_prompt_rows, check_response_width
from verl_ds.prompt_sharing import SharedPacked
from verl_ds.rows import ResponseIndex, index_responses

__all__ = ["response_index", "packed_logprobs", "packed_values", "lm_head_returns_logprobs"]

# config attributes of models whose forward transforms the LM head's output (then the fused head,
# which returns log-probs in place of logits, would be transformed too)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def response_index(packed: Packed | SharedPacked, response_width: int) -> ResponseIndex:
    """The real tokens of the last ``response_width`` columns; each must follow a real token of its row."""
    B, T = packed.shape
    R = response_width
    if packed.targets is not None:  # the packing located them (response_width given, or shared prompts)
        if R != packed.response_width:
            what = "the prompts were shared" if isinstance(packed, SharedPacked) else "the batch was packed"
            raise ValueError(f"response_width R={response_width} differs from the width {what} with "
                             f"({packed.response_width})")
        return packed.targets
    R = check_response_width(R, T)
    flat = packed.indices  # a batch packed whole: rebuild its (B, T) ids, mask and places to read the responses
    mask = torch.zeros(B * T, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True).view(B, T)
    _no_prompt_rows(mask, R)
    ids = torch.zeros(B * T, dtype=torch.int64, device=flat.device).index_copy_(0, flat, packed.input_ids[0])
    place = torch.zeros_like(ids).index_copy_(0, flat, torch.arange(flat.numel(), device=flat.device))
    return index_responses(ids.view(B, T), mask, R, place.view(B, T))


def _scatter(values: torch.Tensor, idx: ResponseIndex, shape: tuple[int, int]) -> torch.Tensor:
    B, R = shape
    if idx.take is not None:  # a pair scored once for every sample that holds it: its gradients add up
        values = values.index_select(0, idx.take)
    return values.new_zeros(B * R).index_copy(0, idx.out, values).view(B, R)


def _accepts(module: Any) -> tuple[set[str], bool]:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return set(), True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return set(params), var_kw


@contextlib.contextmanager
def _witnessed(model: Any, packed: Packed, row: Any):
    """``packed_row_witness`` over the row (this rank's slice of it when sequence-parallel ``row`` is active)."""
    tokens, layout = (packed.num_tokens, packed.layout) if row is None else (row.tokens, row.layout)
    with packed_row_witness(model, tokens, layout, isinstance(packed, SharedPacked)), \
            (row.active() if row is not None else contextlib.nullcontext()):
        yield


def _packed_kwargs(inner: Any, packed: Packed, row: Any = None) -> dict:
    names, var_kw = _accepts(inner)
    src = packed if row is None else row  # a ShardedRow: this rank's slice of the tokens, the whole row's layout
    kwargs = {"input_ids": src.input_ids, "position_ids": src.position_ids}
    if "use_cache" in names or var_kw:
        kwargs["use_cache"] = False
    if var_kw:  # transformers models take the varlen kwargs through **kwargs
        kwargs.update(packed.attention_kwargs() if row is None else row.kwargs)
    return kwargs


@contextlib.contextmanager
def lm_head_returns_logprobs(model: Any, labels: torch.Tensor, temperature: float = 1.0,
                             compute_entropy: bool = True, keep: torch.Tensor | None = None, head_kl: Any = None,
                             **chunks):
    """While active, ``model``'s LM head returns [log-prob of ``labels``, entropy] (..., 2 or 1) float32 instead of
    logits; ``keep``: rows to take of all N; ``head_kl``: one more column (or all). Not thread-safe per model."""
    inner = unwrap_module(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Module) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"lm_head_returns_logprobs: {type(inner).__name__} has no output-embedding Linear "
                        f"(get_output_embeddings() returned {type(head).__name__})")
    cfg = getattr(inner, "config", None)
    for name in _LOGIT_TRANSFORMS:
        val = getattr(cfg, name, None)
        if val not in (None, 1, 1.0):
            raise ValueError(f"lm_head_returns_logprobs: {type(inner).__name__} transforms its logits "
                             f"({name}={val!r}); the fused LM head cannot apply that: use model.fused_lm_head=false "
                             f"for this model")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        lead = hidden.shape[:-1]  # (B, R+1) padded, (1, n) packed
        if keep is not None and h.shape[0] != labels.shape[0]:
            h, lead = h[keep], (1, keep.numel())
        if head_kl is not None and head_kl.replaces_head:
            return head_kl(head, h).view(*lead, -1)
        # weight/bias read here, inside the module call: ZeRO-3 has gathered them
        lp, ent = fused_linear_logprobs(h, head.weight, labels, temperature, getattr(head, "bias", None),
                                        compute_entropy, **chunks)
        cols = [lp] + ([ent] if ent is not None else []) + ([head_kl(head, h)] if head_kl is not None else [])
        return torch.stack(cols, -1).view(*lead, len(cols))

    head.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) still wrap it
    try:
        yield head
    finally:
        del head.forward


def packed_logprobs(lm: Any, packed: Packed, response_width: int, temperature: float = 1.0, *,
                    compute_entropy: bool = False, fused_lm_head: bool = False, head_kl: Any = None,
                    sequence_parallel: Any = None, **chunks):
    """(log_probs, entropy or None), (B, R) float32, 0 at padding: the padded ``get_logprob`` on a packed batch;
    ``fused_lm_head``: no (n, V) logits; ``head_kl``: a third item; ``sequence_parallel``: this rank's slice."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a float > 0, got {temperature!r}")
    idx = response_index(packed, response_width)
    B = packed.shape[0]
    fused_lm_head = fused_lm_head or head_kl is not None  # the extra column rides on the fused head's output
    inner = unwrap_module(lm)
    row, preds, labels = None, idx.preds, idx.label_ids
    if sequence_parallel is not None:  # this rank's slice of the row, and the predictors in it
        row = sequence_parallel.shard(packed)
        mine, preds = row.predictors(idx.preds)
        labels, empty = labels[mine], not preds.numel()
        if empty:  # the LM head still runs (ZeRO-3 gathers it on every rank): on one token, dropped after
            preds, labels = preds.new_zeros(1), labels.new_zeros(1)
    kwargs = _packed_kwargs(inner, packed, row)
    names, _ = _accepts(inner)
    keep_arg = "logits_to_keep" in names
    if keep_arg:
        kwargs["logits_to_keep"] = preds
    if fused_lm_head:
        ctx = lm_head_returns_logprobs(lm, labels, temperature, compute_entropy,
                                       keep=None if keep_arg else preds, head_kl=head_kl, **chunks)
    else:
        ctx = contextlib.nullcontext()
    with ctx, _witnessed(lm, packed, row):
        out = lm(**kwargs)
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[0] != 1:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"packed_logprobs: the lm must return logits of shape (1, n, V) for the packed row, got {got}")
    logits = logits[0]
    if fused_lm_head:
        cols = [logits[:, 0]] + ([logits[:, 1]] if compute_entropy else []) + \
            ([logits[:, -1]] if head_kl is not None else [])
    else:
        if logits.shape[0] != preds.numel():
            logits = logits[preds]
        cols = list(logprobs_and_entropy(logits, labels, temperature)) if compute_entropy else \
            [logprobs_from_logits(logits, labels, temperature)]
    if row is not None:  # every predictor's columns, on every rank of the group
        cols = row.gather(torch.stack(cols, -1)[:0 if empty else None], idx.preds).unbind(-1)
    lp, ent = cols[0], (cols[1] if compute_entropy else None)
    shape = (B, response_width)
    out = _scatter(lp, idx, shape), (_scatter(ent, idx, shape) if ent is not None else None)
    return out if head_kl is None else (*out, _scatter(cols[-1], idx, shape))


def packed_values(critic: Any, packed: Packed, response_width: int, sequence_parallel: Any = None) -> torch.Tensor:
    """(B, R) float32 values of a packed batch, as ``ValueModel.get_values``, 0 at padded positions."""
    idx = response_index(packed, response_width)
    row = sequence_parallel.shard(packed) if sequence_parallel is not None else None
    with _witnessed(critic, packed, row):
        out = critic(**_packed_kwargs(unwrap_module(critic), packed, row))
    if not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
        out = out.logits
    if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[-1] == 1:
        out = out.squeeze(-1)
    n = packed.num_tokens if row is None else row.local
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, n):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"packed_values: the critic must return per-token values of shape (1, N) = (1, {n}) for "
                         f"the packed row, got {got}")
    if row is None:
        values = out[0, idx.preds]
    else:
        values = row.gather(out[0, row.predictors(idx.preds)[1]], idx.preds)
    return _scatter(values.float(), idx, (packed.shape[0], response_width))
