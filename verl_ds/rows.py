"""Where the tokens of a padded (B, T) batch stand: one rule per question every packing and forward asks, so the
packings, the token budgets and shared generation cannot disagree."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["ResponseIndex", "check_ids_and_mask", "prompt_groups", "position_ids_from_mask", "index_responses"]


class ResponseIndex(NamedTuple):
    """The real response tokens of a packed batch: ``label_ids`` (n,); ``preds`` (n,) the packed indices whose
    outputs predict them; ``out`` (n,) row * R + column in the (B, R) response block; ``take`` (m,) with shared
    response prefixes: place i of ``out`` reads the scored pair ``take[i]`` (None: one each)."""

    label_ids: torch.Tensor
    preds: torch.Tensor
    out: torch.Tensor
    take: torch.Tensor | None = None


def check_ids_and_mask(observation: Any, mask: Any, who: str, names: tuple = ("observation", "mask")) -> tuple:
    """(ids as int64, mask as bool) of a (B, T) batch; a (B, T, T) mask is refused (some HF models mask all out)."""
    ids, m = names
    if not isinstance(observation, torch.Tensor):
        raise TypeError(f"{who}: {ids} must be a (B, T) int64 tensor of token ids, got {type(observation).__name__}")
    if observation.dim() != 2:
        raise ValueError(f"{who}: {ids} must be 2-D (B, T), got shape {tuple(observation.shape)}")
    if observation.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{who}: {ids} must hold int64 token ids, got dtype {observation.dtype}")
    if observation.shape[1] == 0:
        raise ValueError(f"{who}: {ids} is empty: shape {tuple(observation.shape)}")
    if mask is None:
        return observation.long(), torch.ones_like(observation, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{who}: {m} must be a (B, T) bool tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(observation.shape):
        extra = (" (pass the (B, T) attention mask, not a (B, T, T) attention matrix)" if mask.dim() == 3 else "")
        raise ValueError(f"{who}: {m} must have the shape of {ids}, (B, T) = {tuple(observation.shape)}, "
                         f"got {tuple(mask.shape)}{extra}")
    if mask.device != observation.device:
        raise ValueError(f"{who}: {m} is on {mask.device} but {ids} is on {observation.device}")
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.is_complex():
            raise TypeError(f"{who}: {m} must be bool (or 0/1 integers), got dtype {mask.dtype}")
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{who}: {m} must hold only 0/1, got values {sorted(set(mask.unique().tolist()) - {0, 1})[:5]}")
        mask = mask.bool()
    empty = ~mask.any(-1)
    if bool(empty.any()):
        raise ValueError(f"{who}: {m} rows {empty.nonzero().flatten().tolist()} have no real token; every sequence "
                         f"needs at least one")
    return observation.long(), mask


def prompt_groups(input_ids: torch.Tensor, mask: torch.Tensor, width: int | None = None) -> tuple:
    """(group (B,), first (G,)) int64: rows share a prompt when their first ``width`` columns hold the same real
    tokens in the same places (pads equal whatever their id)."""
    P = input_ids.shape[1] if width is None else int(width)
    key = input_ids[:, :P].long().masked_fill(~mask[:, :P].bool(), -1)
    distinct, group = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((distinct.shape[0],), key.shape[0], device=key.device).scatter_reduce(0, group, rows, "amin")
    order = torch.argsort(first)
    renumber = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=key.device))
    return renumber[group], first[order]


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each token's index among its row's real tokens, so left padding does not shift positions (as HF generate)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def index_responses(input_ids: torch.Tensor, mask: torch.Tensor, response_width: int, place: torch.Tensor,
                    order: torch.Tensor | None = None) -> ResponseIndex:
    """The ``ResponseIndex`` of the last ``response_width`` columns, packed at ``place`` (B, T), rows in ``order``."""
    B, T = mask.shape
    P = T - response_width
    rows, cols = (mask[:, P:] if order is None else mask[order, P:]).nonzero().unbind(1)
    rows, cols = (rows if order is None else order[rows]), cols + P
    rank = position_ids_from_mask(mask)
    real = mask.nonzero(as_tuple=True)
    by_rank = torch.zeros_like(place)  # by_rank[b, i]: where the row's i-th real token is packed
    by_rank[real[0], rank[real]] = place[real]
    return ResponseIndex(label_ids=input_ids[rows, cols].long(), preds=by_rank[rows, rank[rows, cols] - 1],
                         out=rows * response_width + cols - P)
