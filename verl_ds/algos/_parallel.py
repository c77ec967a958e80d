"""Run a chunked row loop on CPU with one Python thread per intra-op thread, each op single-threaded.

The chunked torch paths issue thousands of small, cache-resident ops. Under OpenMP every op is a
fork/join: a few microseconds each on an idle machine, and up to a scheduler tick each when other
processes hold the cores (measured here: a 8192x32000 log-prob pass going from 0.4 s to 16-80 s).
Splitting the rows into contiguous ranges, one per thread, with torch's intra-op threads set to 1
for the duration, leaves no barrier but the final join; torch releases the GIL inside each op.
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


def run_row_ranges(n_rows: int, rows_per_chunk: int, work, device: torch.device) -> None:
    """Call ``work(lo, hi)`` over [0, n_rows) split into contiguous, chunk-aligned ranges.

    On CPU the ranges run concurrently, one per intra-op thread, with single-threaded ops; elsewhere
    (CUDA) there is one range. ``work`` must only write its own rows."""
    n_chunks = -(-n_rows // rows_per_chunk) if n_rows else 0
    threads = torch.get_num_threads()
    workers = min(threads, n_chunks)
    if device.type != "cpu" or workers <= 1 or not _SECTION_LOCK.acquire(blocking=False):
        work(0, n_rows)
        return
    try:
        bounds = [min(n_rows, (n_chunks * i // workers) * rows_per_chunk) for i in range(workers + 1)]
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
