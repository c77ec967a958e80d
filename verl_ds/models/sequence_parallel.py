"""DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2023, arXiv:2309.14509; ``model.sequence_parallel_size``):
each rank of a group runs the model on 1/sp of a packed row's tokens, and each attention call trades that slice for
all tokens of heads/sp heads (DeepSpeed's all-to-all). Why the update equals sp=1's: docs/launch.md, "Long sequences".
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from verl_ds.attention_layout import LAYOUT_KWARG, AttentionLayout
from verl_ds.models.varlen_attention import ULYSSES_PREFIX

__all__ = ["SequenceParallel", "init_sequence_parallel", "setup_sequence_parallel", "turns", "ShardedRow",
           "register_ulysses", "ulysses_name", "check_heads", "ULYSSES_PREFIX"]


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's group: ``group``, its ``size``, this rank's index ``rank`` and the members' global ``ranks``."""
    group: Any
    size: int
    rank: int
    ranks: tuple

    def turns(self, batch) -> Iterator[tuple[Any, bool]]:
        """(micro-batch, mine) for each rank of the group in order: its micro-batch ``batch`` (a RolloutBatch)
        broadcast to the group; ``mine``: it is this rank's. Collective over the group."""
        from verl_ds.batch import RolloutBatch

        device = _device_of(batch)
        for j, src in enumerate(self.ranks):  # a RolloutBatch as plain data: its fields and extras
            box = [(dict(batch.to("cpu").items()), batch.extras) if j == self.rank else None]
            dist.broadcast_object_list(box, src=src, group=self.group)
            yield (batch, True) if j == self.rank else (RolloutBatch(extras=box[0][1], **box[0][0]).to(device), False)

    def shard(self, packed: Any) -> "ShardedRow":
        """This rank's slice of a packed row (``Packed`` or ``SharedPacked``)."""
        return ShardedRow(packed, self)


def _device_of(batch) -> torch.device:
    for _, t in batch.items():
        return t.device
    return torch.device("cpu")


def init_sequence_parallel(degree: int) -> SequenceParallel | None:
    """This rank's group of ``degree`` consecutive ranks (a collective: every rank creates every group); None for 1."""
    if degree == 1:
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    if world % degree:
        raise ValueError(f"model.sequence_parallel_size={degree} must divide the world size {world}")
    mine = None
    for start in range(0, world, degree):
        ranks = tuple(range(start, start + degree))
        group = dist.new_group(list(ranks))
        if me in ranks:
            mine = SequenceParallel(group=group, size=degree, rank=ranks.index(me), ranks=ranks)
    return mine


def check_heads(heads: int, kv_heads: int, degree: int, key: str = "model.sequence_parallel_size") -> str | None:
    """Why ``degree`` cannot split these heads (None when it can): each rank gets heads/degree and kv_heads/degree."""
    if heads % degree or kv_heads % degree:
        return (f"{key}={degree} must divide the attention heads ({heads}) and the key/value heads ({kv_heads}): "
                f"each rank attends heads/{degree} of them")
    return None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather rows of different counts over the group; backward: this rank's own rows of the gradient (every rank
    computes the same function of the gathered rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list, sp: SequenceParallel) -> torch.Tensor:
        top = max(counts)
        buf = x.new_zeros((top, *x.shape[1:]))
        buf[:x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in range(sp.size)]
        dist.all_gather(parts, buf.contiguous(), group=sp.group)
        ctx.start, ctx.count = sum(counts[:sp.rank]), counts[sp.rank]
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start:ctx.start + ctx.count], None, None


class ShardedRow:
    """A packed row padded to ``size * local`` tokens and this rank's slice [start, end): the model's inputs, the
    whole row's ``layout`` its attention attends, and ``gather`` of per-predictor outputs back onto every rank."""

    def __init__(self, packed: Any, sp: SequenceParallel):
        n = packed.num_tokens
        self.sp, self.local = sp, math.ceil(n / sp.size)
        self.tokens = self.local * sp.size
        pad = self.tokens - n
        ids, pos, layout = packed.input_ids, packed.position_ids, packed.layout
        kwargs = dict(packed.attention_kwargs())
        if pad:  # one more sequence after the real tokens: causal, so no real token sees it
            ids = torch.cat([ids, ids.new_zeros((1, pad))], 1)
            pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], 1)
            layout = AttentionLayout(starts=layout.starts + (self.tokens,), parents=layout.parents + (-1,),
                                     first_pos=layout.first_pos + (0,), device=layout.device)
            if "cu_seq_lens_q" in kwargs:  # flash-attention's varlen offsets, as the padded row's
                cu = torch.cat([kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_q"].new_tensor([self.tokens])])
                longest = max(kwargs["max_length_q"], pad)
                kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        kwargs[LAYOUT_KWARG] = layout
        self.layout, self.attention = layout, {**kwargs, "position_ids": pos}
        self.start, self.end = sp.rank * self.local, (sp.rank + 1) * self.local
        self.input_ids, self.position_ids = ids[:, self.start:self.end], pos[:, self.start:self.end]
        self.kwargs = kwargs  # what the model's forward is given besides ids and positions

    def predictors(self, preds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mine, local): which predictor indices ``preds`` lie in this rank's slice, and their local indices."""
        mine = (preds >= self.start) & (preds < self.end)
        return mine, preds[mine] - self.start

    def gather(self, values: torch.Tensor, preds: torch.Tensor) -> torch.Tensor:
        """This rank's outputs (k, ...) for its predictors, in order -> (len(preds), ...) on every rank of the group;
        differentiable (the backward keeps this rank's rows)."""
        owner = torch.div(preds, self.local, rounding_mode="floor")
        counts = torch.bincount(owner, minlength=self.sp.size).tolist()
        if values.shape[0] != counts[self.sp.rank]:
            raise ValueError(f"sequence parallel: {values.shape[0]} outputs for {counts[self.sp.rank]} predictors")
        rows = _GatherFromGroup.apply(values, counts, self.sp)
        order = torch.sort(owner, stable=True).indices  # gathered rows come owner by owner, each in predictor order
        return rows.new_zeros(rows.shape).index_copy(0, order, rows)

    @contextlib.contextmanager
    def active(self):
        """While a forward of this row runs: its attention calls go through the all-to-all (``ulysses_attention``)."""
        token = _ROW.set(self)
        try:
            yield self
        finally:
            _ROW.reset(token)


_ROW: contextvars.ContextVar = contextvars.ContextVar("verl_ds_sequence_parallel_row", default=None)


def _all_to_all(x: torch.Tensor, scatter: int, gather: int, sp: SequenceParallel) -> torch.Tensor:
    from deepspeed.sequence.layer import _SeqAllToAll

    return _SeqAllToAll.apply(sp.group, x, scatter, gather, 0)


def ulysses_name(inner: str) -> str:
    """The registered name of the Ulysses wrapper around attention ``inner`` (``register_ulysses``)."""
    return inner if inner.startswith(ULYSSES_PREFIX) else ULYSSES_PREFIX + inner


def register_ulysses(inner: str) -> str:
    """Register the Ulysses wrapper around attention function ``inner`` (transformers' or ours); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from verl_ds.models.varlen_attention import _varlen_mask, register_varlen_attention

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_varlen_attention()
    name = ulysses_name(inner)
    base = inner[len(ULYSSES_PREFIX):] if inner.startswith(ULYSSES_PREFIX) else inner
    if base not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"sequence parallel: attention {base!r} is not a registered attention function to wrap")

    def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
        """Outside a sequence-parallel forward: ``base`` unchanged. Inside: query (1, H, n, d) and key/value
        (1, KV, n, d) of this rank's slice -> all-to-all -> ``base`` on (1, H/sp, N, d) over the whole row ->
        all-to-all -> ((1, n, H, d), None)."""
        fn = ALL_ATTENTION_FUNCTIONS[base]
        row = _ROW.get()
        if row is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        sp = row.sp
        if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != row.local:
            raise ValueError(f"sequence parallel: the attention of {type(module).__name__} got a "
                             f"{tuple(query.shape)} query{' and a mask' if attention_mask is not None else ''}; "
                             f"expected one packed slice of {row.local} tokens without a mask")
        for what, t in (("heads", query), ("key/value heads", key)):
            if t.shape[1] % sp.size:
                raise ValueError(f"model.sequence_parallel_size={sp.size} must divide the {what} ({t.shape[1]})")
        q, k, v = (_all_to_all(t.transpose(1, 2), 2, 1, sp).transpose(1, 2) for t in (query, key, value))
        kwargs.update(row.attention)  # the whole padded row's layout, offsets and position ids
        if not base.startswith("verl_ds_"):  # our kernels tell the witness themselves
            from verl_ds.models.varlen_attention import _WITNESS

            witness = _WITNESS.get()
            if witness is not None:
                witness.record(module, q, k, None, row.layout, row.attention["position_ids"])
        out, _ = fn(module, q, k, v, None, **kwargs)  # (1, N, H/sp, d)
        return _all_to_all(out, 1, 2, sp), None

    AttentionInterface.register(name, ulysses_attention)
    AttentionMaskInterface.register(name, _varlen_mask)
    return name


def setup_sequence_parallel(degree: int, engines: dict, packed: bool) -> SequenceParallel | None:
    """This rank's group (a collective), every engine's attention wrapped in the all-to-all; a ConfigError naming the
    key for padded batches, heads the degree does not divide or an attention outside ``AttentionInterface``."""
    from verl_ds.config import ConfigError
    from verl_ds.hf_module import config_of, family_name, text_config
    from verl_ds.models.varlen_attention import use_attention

    if degree == 1:
        return None
    key = f"model.sequence_parallel_size={degree}"
    if not packed:
        raise ConfigError(f"{key} splits packed rows, but these models score padded batches (model.remove_padding "
                          f"fell back, see the log line above)")
    for role, engine in engines.items():
        conf = text_config(engine)
        heads = getattr(conf, "num_attention_heads", None)
        why = check_heads(heads, getattr(conf, "num_key_value_heads", None) or heads, degree) if heads else None
        if why:
            raise ConfigError(f"{why} ({role}: {family_name(engine)})")
        try:
            use_attention(engine, register_ulysses(str(config_of(engine)._attn_implementation)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: the {role} ({family_name(engine)}) cannot be split: {exc}") from None
    return init_sequence_parallel(degree)


def turns(sp: SequenceParallel | None, batch) -> Iterator[tuple[Any, bool]]:
    """``sp.turns(batch)``; without sequence parallelism, ``(batch, True)`` once."""
    if sp is None:
        yield batch, True
    else:
        yield from sp.turns(batch)
