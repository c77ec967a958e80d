"""Group ids (any hashables: verl passes uuid strings) -> 0..G-1, and per-group statistics vectorised over samples
with scatter adds. A group is the samples drawn for one prompt.
"""
from __future__ import annotations

import numbers

import numpy as np
import torch


def group_inverse(group_index, batch_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """(inverse, G): sample i's group in 0..G-1, an int64 (B,) tensor on ``device``, and the number of ids."""
    if isinstance(group_index, torch.Tensor):
        if group_index.dim() != 1 or group_index.is_floating_point() or group_index.is_complex():
            raise TypeError(f"group_index as a tensor must be a 1-D integer tensor of B ids, got dtype "
                            f"{group_index.dtype} and shape {tuple(group_index.shape)}")
        _check_len(len(group_index), batch_size)
        uniq, inv = torch.unique(group_index, return_inverse=True)
        return inv.to(device=device, dtype=torch.int64), int(uniq.numel())
    if isinstance(group_index, (str, bytes)) or not hasattr(group_index, "__len__"):
        raise TypeError(f"group_index must be a length-B sequence, numpy array or integer tensor of group ids, "
                        f"got {type(group_index).__name__}")
    _check_len(len(group_index), batch_size)
    if isinstance(group_index, np.ndarray) and group_index.ndim != 1:
        raise ValueError(f"group_index must be 1-D, got a numpy array of shape {group_index.shape}")
    if isinstance(group_index, np.ndarray) and group_index.dtype.kind in "biuUS":
        uniq, inv = np.unique(group_index, return_inverse=True)
        return torch.as_tensor(inv.reshape(-1), dtype=torch.int64, device=device), int(len(uniq))
    codes: dict = {}
    try:  # hashing only: ids need not be comparable (mixed types, tuples)
        inv = [codes.setdefault(g, len(codes)) for g in group_index]
    except TypeError as e:
        raise TypeError(f"group_index entries must be hashable group ids: {e}") from None
    return torch.tensor(inv, dtype=torch.int64, device=device), len(codes)


def _check_len(n: int, batch_size: int) -> None:
    if n != batch_size:
        raise ValueError(f"group_index has {n} entries but there are {batch_size} samples (rows); "
                         "give one group id per sample")


def group_sums(x: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-group sums of the (B,) tensor ``x``: (G,) in x's dtype."""
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_count_mean_std(scores: torch.Tensor, inverse: torch.Tensor, n_groups: int):
    """(count, mean, unbiased std) per sample's group, each (B,) float64; a group of one sample has mean 0 and
    std 1, as in verl (its advantage is then its own score)."""
    ones = torch.ones_like(scores)
    count = group_sums(ones, inverse, n_groups)[inverse]
    mean = (group_sums(scores, inverse, n_groups)[inverse]) / count
    dev = scores - mean
    var = group_sums(dev * dev, inverse, n_groups)[inverse] / (count - 1).clamp(min=1)
    single = count == 1
    return count, torch.where(single, 0.0, mean), torch.where(single, 1.0, var.sqrt())


def check_int(value, name: str, *, minimum: int = 0) -> int:
    """An int >= minimum (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)
