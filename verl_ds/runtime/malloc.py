"""glibc malloc for a CPU training process: freed memory is kept for reuse instead of going back to the OS.

glibc gives the top of its heap back to the OS once more than ``M_TRIM_THRESHOLD`` bytes lie free there (by default
twice the dynamic mmap threshold, a few MiB once tensors of that size have come and gone), and the next allocation of
that memory faults every page in again. A training step frees and allocates the same tensors at every micro-batch
(activations, each weight's gradient: 4 MiB apiece at 30M parameters), so a CPU step spends part of its time in page
faults: writing into fresh pages runs at a few GB/s, into pages already mapped at tens (see mallopt(3)). jemalloc and
tcmalloc keep freed memory, which is why CPU tuning guides preload one of them (``torch.backends.xeon.run_cpu``,
https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#switch-memory-allocator); ``keep_freed_memory`` asks
glibc itself for the same with two ``mallopt`` calls: no trimming of the heap, and a fixed mmap threshold at glibc's
largest (32 MiB: below it everything comes from the heap and is reused; larger blocks are still mapped and unmapped
as before). The cost: the process keeps the peak of its heap resident, as with those allocators.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from <malloc.h>
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest means "never trim"
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)

__all__ = ["keep_freed_memory", "glibc_version"]


def glibc_version() -> str | None:
    """The C library's glibc version ("2.36"), or None when the process does not run on glibc (musl, macOS)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    return version if name == "glibc" else None


def keep_freed_memory() -> bool:
    """Make this process's glibc malloc keep freed memory (see the module docstring); returns whether both settings
    took. A no-op returning False on another C library."""
    version = glibc_version()
    if version is None:
        log.info("not glibc: malloc left as it is (trainer.cpu_keep_freed_memory applies to glibc only)")
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # the mmap threshold first: a fixed trim threshold alone also fixes the mmap threshold at its 128 KiB start,
    # and then every larger tensor is mapped and unmapped (worse than the default)
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("glibc %s malloc keeps freed memory (M_TRIM_THRESHOLD=%d, M_MMAP_THRESHOLD=%d)", version,
                 TRIM_THRESHOLD, MMAP_THRESHOLD)
    else:
        log.warning("glibc %s refused mallopt(M_TRIM_THRESHOLD / M_MMAP_THRESHOLD): malloc left as it is", version)
    return ok
