"""Chunked row loops for the CPU torch paths: a chunk plan over (N, V) or (B, T, V) row blocks, run with
one Python thread per intra-op thread and single-threaded ops.

The chunked paths issue thousands of small, cache-resident ops. Under OpenMP every op is a fork/join:
a few microseconds on an idle machine, and up to a scheduler tick each when other processes hold the
cores (measured here: an 8192x32000 log-prob pass going from 0.4 s to 16-80 s). Splitting the chunks
into contiguous ranges, one per thread, with torch's intra-op threads set to 1 for the duration,
leaves no barrier but the final join; torch releases the GIL inside each op.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# set_num_threads is process-wide: one parallel section at a time, others run serially meanwhile
_SECTION_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < workers:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verl_ds_algos")
        return _POOL


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


def run_ranges(n_items: int, work, device: torch.device) -> None:
    """Call ``work(lo, hi)`` over [0, n_items) split into contiguous ranges.

    On CPU the ranges run concurrently, one per intra-op thread, with single-threaded ops; elsewhere
    (CUDA) there is one range. ``work`` must only write its own items' outputs."""
    threads = torch.get_num_threads()
    workers = min(threads, n_items)
    if device.type != "cpu" or workers <= 1 or not _SECTION_LOCK.acquire(blocking=False):
        work(0, n_items)
        return
    try:
        bounds = [n_items * i // workers for i in range(workers + 1)]
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def in_caller_mode(lo, hi):  # grad and inference mode are thread-local: carry the caller's over
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                work(lo, hi)

        torch.set_num_threads(1)
        try:
            futures = [_pool(workers - 1).submit(in_caller_mode, bounds[i], bounds[i + 1])
                       for i in range(1, workers)]
            error = None
            try:
                work(bounds[0], bounds[1])
            except BaseException as exc:  # still wait for the workers before re-raising
                error = exc
            for f in futures:
                try:
                    f.result()
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error
        finally:
            torch.set_num_threads(threads)
    finally:
        _SECTION_LOCK.release()
