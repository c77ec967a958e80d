"""Pack a padded (B, T) micro-batch into one (1, N) row, and split samples by a token budget into the same number of
micro-batches on every rank (so ZeRO-3 collectives line up). Design: docs/models.md, "Packed rows"."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from verl_ds.attention_layout import LAYOUT_KWARG, AttentionLayout
from verl_ds.rows import ResponseIndex, check_ids_and_mask, index_responses, position_ids_from_mask, prompt_groups

__all__ = ["Packed", "pack", "unpack", "count_micro_batches", "token_budget_micro_batches",
           "agree_num_micro_batches", "micro_batch_groups"]

PACK_NAMES = ("input_ids", "attention_mask")  # what the packers' errors call their arguments


@dataclass(frozen=True)
class Packed:
    """A padded (B, T) batch without its padding: input_ids, position_ids (1, N); cu_seqlens (B + 1,) int32
    (flash-attn's varlen offsets); indices (N,): row * T + column in the padded batch; lengths (B,)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
    max_seqlen: int
    shape: tuple[int, int]
    targets: ResponseIndex | None = None
    response_width: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.indices.numel())

    @functools.cached_property
    def layout(self) -> AttentionLayout:
        """One sequence per row (``verl_ds.attention_layout``), built once per micro-batch."""
        return AttentionLayout.sequences(self.lengths.tolist(), self.input_ids.device)

    def attention_kwargs(self) -> dict:
        """What every layer's attention reads, the same objects for every layer so no layer syncs the host."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen, LAYOUT_KWARG: self.layout}


def check_response_width(response_width, T: int) -> int:
    if isinstance(response_width, bool) or not isinstance(response_width, int) or not 1 <= response_width < T:
        raise ValueError(f"response_width (R) must be an int with 1 <= R < T={T}, got {response_width!r}")
    return response_width


def last_response_token(mask: torch.Tensor, response_width: int) -> torch.Tensor:
    """(B, T) bool: each row's last real token if it is in the last ``response_width`` columns (a label only)."""
    T = mask.shape[1]
    counts = mask.long().cumsum(1)
    last = mask & (counts == counts[:, -1:])
    return last & (torch.arange(T, device=mask.device) >= T - response_width)[None, :]


def _no_prompt_rows(mask: torch.Tensor, response_width: int) -> None:
    P = mask.shape[1] - response_width
    empty = (~mask[:, :P].any(1) & mask[:, P:].any(1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} have no real token before their response (an empty prompt): nothing "
                         f"predicts the first response token")


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int | None = None) -> Packed:
    """``input_ids`` (B, T) without padding; with ``response_width`` each row's last response token is left out."""
    input_ids, mask = check_ids_and_mask(input_ids, attention_mask, "pack", PACK_NAMES)
    B, T = input_ids.shape
    full = mask
    if response_width is not None:
        R = check_response_width(response_width, T)
        _no_prompt_rows(mask, R)
        mask = mask & ~last_response_token(mask, R)
    lengths = mask.sum(-1)
    indices = mask.reshape(-1).nonzero().flatten()
    cu = torch.zeros(B + 1, dtype=torch.int64, device=input_ids.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    positions = position_ids_from_mask(mask).reshape(-1)[indices]
    targets = None
    if response_width is not None:
        place = torch.zeros(B * T, dtype=torch.int64, device=input_ids.device)
        place.index_copy_(0, indices, torch.arange(indices.numel(), device=input_ids.device))
        targets = index_responses(input_ids, full, R, place.view(B, T))
    return Packed(input_ids=input_ids.reshape(-1)[indices].long().unsqueeze(0),
                  position_ids=positions.unsqueeze(0), cu_seqlens=cu.to(torch.int32), indices=indices,
                  lengths=lengths, max_seqlen=int(lengths.max()), shape=(B, T), targets=targets,
                  response_width=response_width)


def unpack(packed: Packed, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token ``values`` (N, ...) or (1, N, ...) back to (B, T, ...), ``fill`` at padding (differentiable)."""
    n = packed.num_tokens
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"unpack: values must be a tensor of shape (N, ...) or (1, N, ...), got "
                        f"{type(values).__name__}")
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == n:
        values = values[0]
    if values.dim() == 0 or values.shape[0] != n:
        raise ValueError(f"unpack: values must have shape (N, ...) or (1, N, ...) with N = {n} packed tokens, got "
                         f"{tuple(values.shape)}")
    B, T = packed.shape
    out = values.new_full((B * T, *values.shape[1:]), fill)
    return out.index_copy(0, packed.indices.to(values.device), values).view(B, T, *values.shape[1:])


# ---- token-budget micro-batches ------------------------------------------------------------------------

def _check_lengths(lengths, max_tokens) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be a 1-D integer tensor or a list of ints, got a {lengths.dtype} tensor "
                             f"of shape {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    lengths = list(lengths)
    if not lengths:
        raise ValueError("lengths is empty: there are no samples to split into micro-batches")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"lengths[{i}] must be a positive int (the sample's token count), got {n!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens (actor.max_tokens_per_micro_batch) must be a positive int, got {max_tokens!r}")
    return lengths


def _order(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, ties by index


def _first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _order(lengths):
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:  # a sample over the budget opens a bin no other sample fits in
            bins.append([i])
            loads.append(n)
    return bins


def count_micro_batches(lengths, max_tokens: int) -> int:
    """The micro-batches this rank needs for ``lengths`` under ``max_tokens`` each (first-fit decreasing)."""
    return len(_first_fit_decreasing(_check_lengths(lengths, max_tokens), max_tokens))


def agree_num_micro_batches(local_count: int, group=None) -> int:
    """The largest ``local_count`` over the ranks of ``group`` (all-reduce MAX)."""
    if isinstance(local_count, bool) or not isinstance(local_count, int) or local_count < 1:
        raise ValueError(f"local_count must be a positive int, got {local_count!r}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local_count
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([local_count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _least_loaded_fit(lengths, k, max_tokens):
    """Longest first onto the least-loaded of k micro-batches it fits in; None when some sample fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in _order(lengths):
        n = lengths[i]
        if n <= max_tokens:
            fits = [b for b in range(k) if loads[b] + n <= max_tokens]
        else:
            fits = [b for b in range(k) if not bins[b]]
        if not fits:
            return None
        b = min(fits, key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += n
    return bins


def _rebalance(bins, lengths, max_tokens):
    """Move single samples from the heaviest bin to the lightest while that lowers the heavier (first-fit
    decreasing leaves the last bins light); each move lowers the sum of squared loads, so it ends."""
    loads = [sum(lengths[i] for i in b) for b in bins]

    def move(i, src, dst):
        bins[src].remove(i)
        bins[dst].append(i)
        loads[src] -= lengths[i]
        loads[dst] += lengths[i]

    for e in [b for b in range(len(bins)) if not bins[b]]:
        donor = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: (loads[b], -b))
        move(min(bins[donor], key=lambda j: (lengths[j], j)), donor, e)
    for _ in range(10 * len(lengths)):  # a bound on the moves; in practice a handful
        hi = max(range(len(bins)), key=lambda b: (loads[b], -b))
        lo = min(range(len(bins)), key=lambda b: (loads[b], b))
        gap = loads[hi] - loads[lo]
        movable = [i for i in bins[hi] if len(bins[hi]) > 1 and lengths[i] < gap
                   and loads[lo] + lengths[i] <= max_tokens]
        if not movable:
            return bins
        move(max(movable, key=lambda j: (min(lengths[j], gap - lengths[j]), -j)), hi, lo)  # closest to half the gap
    return bins


def token_budget_micro_batches(lengths, max_tokens: int, num_micro_batches: int | None = None) -> list[list[int]]:
    """Sample indices in ``num_micro_batches`` (None: this rank's count) balanced micro-batches of <= ``max_tokens``."""
    lengths = _check_lengths(lengths, max_tokens)
    needed = count_micro_batches(lengths, max_tokens)
    k = needed if num_micro_batches is None else num_micro_batches
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_micro_batches must be a positive int, got {num_micro_batches!r}")
    if k < needed:
        raise ValueError(f"num_micro_batches={k} is too few: these {len(lengths)} samples ({sum(lengths)} tokens) "
                         f"need {needed} micro-batches of at most {max_tokens} tokens; agree on the MAX of every "
                         f"rank's count_micro_batches")
    if k > len(lengths):
        raise ValueError(f"num_micro_batches={k} exceeds the {len(lengths)} samples on this rank: a micro-batch would "
                         f"be empty (give every rank the same number of samples, at least the agreed count)")
    bins = _least_loaded_fit(lengths, k, max_tokens)
    if bins is None:
        bins = _first_fit_decreasing(lengths, max_tokens)
        bins += [[] for _ in range(k - len(bins))]
    bins = _rebalance(bins, lengths, max_tokens)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _shared_units(batch, budget: int) -> tuple[list[list[int]], list[int]]:
    """Rows grouped as the shared packing puts them, with their cost; one over ``budget`` is cut, each piece paying
    the prompt."""
    prompt = batch.prompt_length.tolist()
    response = batch.response_length.tolist()
    group = prompt_groups(batch.observation, batch.mask, batch.prompt_width)[0].tolist()
    members: list[list[int]] = [[] for _ in range(max(group, default=-1) + 1)]
    for row, g in enumerate(group):
        members[g].append(row)
    units, costs = [], []
    for rows in members:
        piece, cost = [], 0
        for row in rows:
            if piece and cost + response[row] > budget:
                units.append(piece)
                costs.append(cost)
                piece, cost = [], 0
            cost += response[row] + (0 if piece else prompt[row])
            piece.append(row)
        units.append(piece)
        costs.append(cost)
    return units, costs


def micro_batch_groups(batch, size: int, budget: int | None, share_prompts: bool = False) -> list[list[int]]:
    """Row groups of a RolloutBatch: ``size`` rows each, or by a token budget with the same number of groups on
    every rank (a collective; ``share_prompts``: a prompt's samples together, costing the prompt once)."""
    if budget is None:
        return [list(range(i, min(i + size, len(batch)))) for i in range(0, len(batch), size)]
    if not share_prompts:
        lengths = batch.mask.sum(-1).tolist()
        return token_budget_micro_batches(lengths, budget, agree_num_micro_batches(count_micro_batches(lengths, budget)))
    units, costs = _shared_units(batch, budget)
    k = agree_num_micro_batches(count_micro_batches(costs, budget))
    while len(units) < k:  # another rank needs more micro-batches than this one has groups: cut the largest
        i = max(range(len(units)), key=lambda u: (len(units[u]), costs[u]))
        if len(units[i]) < 2:
            break  # fewer rows than micro-batches: token_budget_micro_batches says so
        rows, half = units[i], len(units[i]) // 2
        prompt = int(batch.prompt_length[rows[0]])
        units[i:i + 1] = [rows[:half], rows[half:]]
        costs[i:i + 1] = [prompt + int(batch.response_length[rows[:half]].sum()),
                          prompt + int(batch.response_length[rows[half:]].sum())]
    bins = token_budget_micro_batches(costs, budget, k)
    return [sorted(row for u in b for row in units[u]) for b in bins]
