"""verl_ds.runtime.malloc: with keep_freed_memory, memory freed by a micro-batch is reused by the next without page
faults; glibc's default gives part of it back to the OS and faults it in again. Each case runs in a fresh
interpreter (malloc settings are per process and cannot be undone)."""
import os
import subprocess
import sys

import pytest

from verl_ds.runtime.malloc import glibc_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a micro-batch's pattern: eight 4 MiB tensors written, then all freed at once (1024 pages each)
PROBE = r"""
import resource, sys
import torch
from verl_ds.runtime.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def cycle():
    ts = [torch.ones(2**20) for _ in range(8)]
    del ts
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_cycle(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    applied, faults = out.stdout.split()[-2:]
    return applied, float(faults)


@pytest.mark.skipif(glibc_version() is None, reason="not glibc")
def test_freed_memory_is_reused_without_page_faults():
    applied, kept = _faults_per_cycle("keep")
    assert applied == "True"
    _, default = _faults_per_cycle("default")
    pages = 8 * 1024
    assert kept < 0.02 * pages, f"{kept} page faults per cycle of {pages} pages with freed memory kept"
    assert default > 10 * max(kept, 1.0), f"glibc's default faulted {default} pages per cycle, kept {kept}"


def test_glibc_version_agrees_with_platform_libc_ver():
    import platform

    lib, version = platform.libc_ver()  # reads the interpreter binary, not confstr
    assert glibc_version() == (version if lib == "glibc" else None)
