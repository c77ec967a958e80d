"""benchmarks/async_rl.py's arithmetic on hand-made metrics rows: tokens/s, busy shares and the 8-GPU projection."""
import pytest

from benchmark_scripts import load_benchmark


def _row(step_s, tokens, gen, wait=None, score=0.5):
    r = {"timing_s/step": step_s, "perf/total_num_tokens": tokens, "timing_s/gen": gen, "timing_s/reward": 0.0,
         "timing_s/update_actor": step_s - gen, "rollout/score/mean": score, "response_length/mean": 16.0,
         "response_length/clip_ratio": 0.25}
    if wait is not None:
        r.update({"timing_s/gen_wait": wait, "async/gen_busy_s": gen, "async/staleness/mean": 1.0})
    return r


def test_figures_and_projection_by_hand():
    b = load_benchmark("async_rl")
    sync = b.figures([_row(1.0, 100, 0.6)] * 6, warmup=1)
    assert sync["tokens_per_s"] == pytest.approx(100.0) and sync["trainer_busy"] == pytest.approx(0.4)
    assert sync["gen_busy"] == pytest.approx(0.6) and sync["score_last"] == 0.5
    stream = b.figures([_row(0.5, 100, 0.6, wait=0.1)] * 6, warmup=1)
    assert stream["tokens_per_s"] == pytest.approx(200.0) and stream["trainer_busy"] == pytest.approx(0.8)
    assert stream["staleness"] == 1.0
    # G = 0.6, T = 0.4, tail = 16 / 64: colocated (G+T)/max(G,T) = 1/0.6; split g=2: max(4*0.6*0.25, 8/6*0.4) = 0.6
    text = b.project(sync, 64)
    assert "at most (G+T)/max(G,T) = 1.67x" in text and "2 generate + 6 train" in text and "= 1.67x" in text
