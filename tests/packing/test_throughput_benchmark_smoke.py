"""benchmarks/throughput.py still runs, at tiny shapes, and ends with its figures line (no timing is asserted).

It runs in a process of its own, as a user runs it: its peak-memory figures read the process's RSS high-water mark,
and inside the test process earlier tests' freed heap memory could serve the measured call (a peak of 0 bytes)."""
import re
import subprocess
import sys

from e2e_utils import ROOT, base_env


def test_quick_run_prints_the_table_and_the_last_line():
    proc = subprocess.run([sys.executable, "benchmarks/throughput.py", "--quick", "--threads", "1"], cwd=ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "remove padding + token budget" in out and "verl_ds.fused_linear_logprobs" in out
    # the packed update computes the padded update's gradients
    grad_diff = float(re.search(r"max abs gradient difference (\S+)", out).group(1))
    assert grad_diff < 1e-5
    # every implementation of the log-prob phase agrees with float64
    for line in out.splitlines():
        if line.startswith("| verl") or line.startswith("| logits"):
            lp_err, ent_err = (float(x) for x in line.rstrip(" |").split("|")[-1].split("/"))
            assert lp_err < 1e-4 and ent_err < 1e-4, line
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"throughput packed_speedup=(\d+\.\d\d) fused_lm_head_peak_ratio=(\d+\.\d{3}) "
                     r"fused_lm_head_time_ratio=(\d+\.\d\d)", last)
    assert m, last
    speedup, peak_ratio, time_ratio = (float(x) for x in m.groups())
    assert speedup > 0 and time_ratio > 0 and peak_ratio >= 0
