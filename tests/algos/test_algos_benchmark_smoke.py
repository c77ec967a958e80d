"""benchmarks/numerics.py still runs, at tiny shapes (no timing is asserted)."""
import torch

from benchmark_scripts import load_benchmark


def _load():
    return load_benchmark("numerics")


def test_benchmark_sections_run_and_agree_with_float64(capsys):
    bench = _load()
    budget = [0.0]
    bench.bench_logprob(1, 6, 40, torch.float32, 0.7, 1, {}, budget, with_backward=True)
    bench.bench_gae(3, 20, 1, {}, budget)
    bench.bench_symkl(1, 5, 30, 1, budget)
    out = capsys.readouterr().out
    assert "verl_ds.logprobs_and_entropy" in out and "verl_ds.compute_gae" in out
    assert "verl_ds.full_symmetric_kl" in out
    # every accuracy column of our rows is small
    for line in out.splitlines():
        if line.startswith("| `verl_ds."):
            diffs = line.rstrip(" |").split("|")[-1].split("/")
            assert all(float(d) < 1e-4 for d in diffs), line


def test_peer_equivalents_match_the_naive_formulas():
    bench = _load()
    logits, labels = torch.randn(2, 5, 33), torch.randint(0, 33, (2, 5))
    ref = bench.naive_logprob(logits, labels, 1.0)
    torch.testing.assert_close(bench.trl_equiv_selective_log_softmax(logits, labels), ref)
    torch.testing.assert_close(bench.trl_equiv_selective_log_softmax(logits.bfloat16(), labels),
                               bench.naive_logprob(logits.bfloat16(), labels, 1.0))
    torch.testing.assert_close(bench.trl_equiv_entropy(logits), bench.naive_logprob_entropy(logits, labels, 1.0)[1])
