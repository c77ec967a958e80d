"""Chunked row loops for the torch paths: a chunk plan over (N, V) or (B, T, V) row blocks, each chunk small enough
to stay in cache (CPU) and bounded in scratch memory (the Triton-less CUDA fallback)."""
from __future__ import annotations

import torch


def as_row_blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., V) -> a (N, V) view, or a (B, T, V) view when the rows cannot be flattened without a copy
    (e.g. ``logits[:, :-1]`` of a (B, T, V) model output); the last dim is made unit-stride."""
    v = x.shape[-1]
    if x.dim() > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, v)
    except RuntimeError:
        return x.reshape(-1, x.shape[-2], v)


def chunk_plan(x: torch.Tensor, rows: int) -> list:
    """Chunks (block, start, stop, flat_start) of at most ``rows`` rows of a (N, V) or (B, T, V) tensor;
    block is None for 2-D input, flat_start the chunk's first row in the flattened (B*T) order."""
    if x.dim() == 2:
        return [(None, s, min(s + rows, x.shape[0]), s) for s in range(0, x.shape[0], rows)]
    t = x.shape[1]
    return [(b, s, min(s + rows, t), b * t + s) for b in range(x.shape[0]) for s in range(0, t, rows)]


def chunk_rows_of(x: torch.Tensor, chunk) -> torch.Tensor:
    block, start, stop, _ = chunk
    return x[start:stop] if block is None else x[block, start:stop]
