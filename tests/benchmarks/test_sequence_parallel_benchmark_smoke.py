"""benchmarks/sequence_parallel.py still runs (2 gloo ranks, a 512-token row) and ends with its figures line; each
rank of the degree-2 group saves at most 0.6 of the activations of the whole row on one rank (no timing asserted)."""
import re
import subprocess
import sys

import pytest

from e2e_utils import ROOT, base_env

pytestmark = pytest.mark.slow  # several processes


def test_quick_run_prints_the_figures_line():
    proc = subprocess.run([sys.executable, "benchmarks/sequence_parallel.py", "--quick"], cwd=ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"sequence_parallel activation_peak_ratio=(\d+\.\d{3}) step_time_ratio=(\d+\.\d{3})", last)
    assert m, last
    assert 0.4 < float(m.group(1)) <= 0.6 and float(m.group(2)) > 0
