"""verl_ds.runtime.malloc: with keep_freed_memory, memory freed by a micro-batch is reused by the next without page
faults; glibc's default gives part of it back to the OS and faults it in again. Each case runs in a fresh
interpreter (malloc settings are per process and cannot be undone)."""
import os
import subprocess
import sys

import pytest

from verl_ds.runtime.malloc import glibc_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a micro-batch's pattern: eight 4 MiB tensors written, then all freed at once (1024 pages each); then one 16 MiB
# tensor freed (the resident megabytes before and after its free)
PROBE = r"""
import resource, statistics, sys
import torch
from verl_ds.runtime.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
big = torch.ones(2**22)
held = rss_mib()
del big
released = held - rss_mib()
def cycle():
    ts = [torch.ones(2**20) for _ in range(8)]
    del ts
for _ in range(5):
    cycle()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, released, statistics.median(faults))
"""


def _probe(mode: str) -> tuple[str, float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    applied, released, faults = out.stdout.split()[-3:]
    return applied, float(released), float(faults)


@pytest.mark.skipif(glibc_version() is None, reason="not glibc")
def test_freed_memory_stays_resident_and_is_reused_without_page_faults():
    """glibc's default returns a fresh 16 MiB block to the OS when it is freed (above its initial 128 KiB mmap
    threshold, it was mapped for itself) and what it does with a steady micro-batch pattern depends on its dynamic
    thresholds (here 8160, 816 and 102 faults per cycle of 8192 pages in three runs): only the first is asserted."""
    applied, released, kept_faults = _probe("keep")
    assert applied == "True"
    assert released < 1.0, f"{released} MiB went back to the OS when a 16 MiB tensor was freed"
    pages = 8 * 1024
    assert kept_faults < 0.02 * pages, f"median {kept_faults} page faults per cycle of {pages} pages"
    _, default_released, _ = _probe("default")
    assert default_released > 15.0, f"glibc's default gave back {default_released} MiB of a freed 16 MiB tensor"


def test_glibc_version_agrees_with_platform_libc_ver():
    import platform

    lib, version = platform.libc_ver()  # reads the interpreter binary, not confstr
    assert glibc_version() == (version if lib == "glibc" else None)
