"""benchmarks/throughput.py still runs, at tiny shapes, and ends with its figures line (no timing is asserted)."""
import re

from benchmark_scripts import load_benchmark


def test_quick_run_prints_the_table_and_the_last_line(capsys):
    bench = load_benchmark("throughput")
    speedup, peak_ratio, time_ratio = bench.main(["--quick", "--threads", "1"])
    out = capsys.readouterr().out
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
    assert re.fullmatch(r"throughput packed_speedup=\d+\.\d\d fused_lm_head_peak_ratio=\d+\.\d{3} "
                        r"fused_lm_head_time_ratio=\d+\.\d\d", last), last
    assert speedup > 0 and time_ratio > 0 and peak_ratio >= 0
