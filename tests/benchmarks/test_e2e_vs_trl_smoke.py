"""benchmarks/e2e_vs_trl.py: its summary arithmetic on hand-made rows, its argument errors, and real runs of both
sides (TRL's GRPOTrainer and verl_ds GRPO on ZeRO-0) at the smallest size, in the default regime and in the long,
diverse one."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow  # real training runs / several processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "e2e_vs_trl.py")


def _load():
    return load_benchmark("e2e_vs_trl")


def test_summarise_by_hand():
    # 12 steps: 10% is ceil(1.2) = 2 steps at each end; warm-up 2 drops the first two from the timing only
    rows = [{"step_s": s, "cpu_s": s / 4, "tokens": t, "score": sc} for s, t, sc in [
        (9.0, 1, 0.0), (8.0, 1, 0.5), (1.0, 10, 0.1), (2.0, 20, 0.1), (3.0, 30, 0.1), (4.0, 40, 0.1),
        (5.0, 50, 0.1), (6.0, 60, 0.1), (7.0, 70, 0.1), (1.0, 10, 0.1), (1.0, 10, 0.6), (2.0, 10, 1.0)]]
    s = _load().summarise(rows, warmup=2)
    # measured step times 1 2 3 4 5 6 7 1 1 2 -> sorted 1 1 1 2 2 3 4 5 6 7: median (2 + 3) / 2
    assert s["step_s"] == 2.5
    assert s["cpu_s"] == 0.625
    assert s["cpu_tokens_per_s"] == pytest.approx(310 / 8)  # the same tokens over 32 / 4 CPU seconds
    assert s["tokens_per_s"] == pytest.approx(310 / 32)  # 10+20+...+70+10+10+10 tokens over 32 s
    assert s["score_first"] == pytest.approx(0.25)
    assert s["score_last"] == pytest.approx(0.8)
    assert "profile_wall" not in s and "profile_cpu" not in s


def test_summarise_pools_the_measured_steps_of_repeated_runs():
    run = lambda times, score: [{"step_s": t, "cpu_s": t, "tokens": 10, "score": score} for t in times]  # noqa: E731
    s = _load().summarise(run([9.0, 1.0, 2.0], 0.1), warmup=1, repeats=(run([8.0, 4.0, 5.0], 0.9),
                                                                       run([7.0, 3.0, 6.0], 0.9)))
    # each run's first step is warm-up: measured 1 2 | 4 5 | 3 6 -> median (3 + 4) / 2; 60 tokens over 21 s
    assert s["step_s"] == 3.5 and s["tokens_per_s"] == pytest.approx(60 / 21)
    assert s["score_first"] == s["score_last"] == 0.1  # the scores are the first run's


def test_summarise_profile_and_short_runs():
    mod = _load()
    zero = {p: 0.0 for p in mod.PHASES} | {f"cpu_{p}": 0.0 for p in mod.PHASES}
    rows = [{"step_s": t, "cpu_s": c, "tokens": 4, "score": 0.5, **zero}
            for t, c in ((3.0, 0.5), (1.0, 0.9), (2.2, 2.0))]
    rows[0].update(gen=2.0, update_actor=0.5, cpu_gen=0.25)
    rows[1].update(cpu_gen=0.5, cpu_update_actor=0.25)
    rows[2].update(gen=0.7, update_actor=1.1, ref=0.3)
    s = mod.summarise(rows, warmup=5)  # warm-up longer than the run: every step is measured
    assert s["step_s"] == 2.2 and s["cpu_s"] == 0.9 and s["tokens_per_s"] == pytest.approx(12 / 6.2)
    # each profile is the step nearest its median (here the median step itself), its phases as logged
    wall, cpu = s["profile_wall"], s["profile_cpu"]
    assert wall["step_s"] == 2.2 and (wall["gen"], wall["update_actor"], wall["ref"]) == (0.7, 1.1, 0.3)
    assert cpu["step_s"] == 0.9 and (cpu["gen"], cpu["update_actor"], cpu["ref"]) == (0.5, 0.25, 0.0)
    assert "untimed 100 ms" in mod._profile("x", wall)  # 2.2 - (0.7 + 1.1 + 0.3)
    assert "gen 500 ms (56%)" in mod._profile("x", cpu)  # 0.5 of 0.9
    assert s["score_first"] == s["score_last"] == 0.5  # 10% of 3 steps rounds up to one step


def test_arithmetic_floor_by_hand():
    rows = [{"prompt_len": 9.0, "response_len": 9.0}, {"prompt_len": 7.0, "response_len": 8.0},
            {"prompt_len": 7.0, "response_len": 6.0}]
    mod = _load()
    f = mod.arithmetic_floor(rows, warmup=1, samples=128, matmul_params=1000, beta=0.01, rate=1e9)
    # measured steps 2-3: prompts of 7, responses of 7 tokens on average: 128 x 14 = 1792 tokens in the reference
    # and update passes; the generation feeds all but the last sampled token: 128 x 13 = 1664;
    # 1000 params x (2 x 1664 + (2 reference + 6 update) x 1792) = 1.7664e7 FLOP, at 1e9 FLOP/s
    assert f["tokens"] == f["scored_tokens"] == pytest.approx(1792)
    assert f["flop"] == pytest.approx(1.7664e7) and f["floor_s"] == pytest.approx(0.017664)
    # shared prompts and prefill, n = 4, no last response token: every pass sees 32 x 7 + 128 x 6 = 992 tokens
    sh = mod.arithmetic_floor(rows, 1, 128, 1000, beta=0.01, rate=1e9, n=4, shared=True)
    assert sh["scored_tokens"] == pytest.approx(992) and sh["flop"] == pytest.approx(1000 * (2 + 8) * 992)
    assert mod.arithmetic_floor(rows, 1, 128, 1000, beta=0.0, rate=1e9)["flop"] == pytest.approx(1000 * (2 * 1664 + 6 * 1792))
    assert mod.gemm_rate(64, 32, 48, threads=1, seconds=0.05) > 1e6  # FLOP/s of a real product


@pytest.mark.parametrize("args, message", [
    (["--sizes", "huge"], "--sizes must name sizes from"),
    (["--zero-stages", "4"], "stages 0-3"),
    (["--micro-batch", "3"], "--micro-batch must divide prompts per step x n = 128; got 3"),
    (["--repeats", "0"], "--repeats must be >= 1; got 0"),
    (["--verl-ds-variant", "model.share_prompts=false"], "--verl-ds-variant must be NAME:KEY=VALUE"),
    (["--verl-ds-variant", "torch linear:"], "--verl-ds-variant must be NAME:KEY=VALUE"),
    (["--regime", "long"], "--regime must name regimes from ['default', 'long_diverse']; got ['long']"),
    # the long_diverse regime's own job: 8 prompts x n=4
    (["--regime", "default,long_diverse", "--micro-batch", "64"], "prompts per step x n = 32; got 64"),
])
def test_bad_arguments_are_named(args, message):
    with pytest.raises(SystemExit) as exc:
        _load().main(args)
    assert message in str(exc.value)


@pytest.mark.timeout(1500)  # two training processes; minutes on a loaded 2-core machine
def test_both_sides_run_at_the_smallest_size(tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (optional benchmark dependency, setup.py extra 'bench')")
    cmd = [sys.executable, SCRIPT, "--sizes", "tiny", "--steps-tiny", "2", "--warmup", "1", "--zero-stages", "0",
           "--prompts-per-step", "4", "--n", "2", "--micro-batch", "4", "--threads", "1", "--timeout", "600",
           "--work-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = {ln.split()[1]: ln.split() for ln in lines if ln.startswith("tiny ") and len(ln.split()) >= 8}
    assert set(table) == {"trl", "verl_ds"}, proc.stdout
    for row in table.values():
        assert row[-8] == "2"  # both sides logged 2 steps
        step_s, cpu_s, tok_s, cpu_tok_s, first, last = map(float, row[-7:-1])
        assert step_s > 0 and cpu_s > 0 and tok_s > 0 and cpu_tok_s > 0 and 0 <= first <= 1 and 0 <= last <= 1
    final = re.fullmatch(r"e2e_vs_trl (.*)", lines[-1])
    assert final, lines[-1]
    figures = dict(kv.split("=") for kv in final.group(1).split())
    assert {"tiny_step_ratio", "tiny_tokens_per_s_ratio", "tiny_cpu_step_ratio", "tiny_cpu_tokens_per_s_ratio",
            "tiny_score_last_diff", "tiny_floor_step_ratio", "load"} <= set(figures)
    assert any(ln.startswith("  tiny: ") and "FLOP per step" in ln for ln in lines), proc.stdout
    assert all(math.isfinite(float(v)) for v in figures.values())
    for clock in ("wall", "cpu"):
        assert any(f"tiny verl_ds ZeRO-0 {clock}: step" in ln and "update_actor" in ln for ln in lines), clock
    # the TRL side ran with the settings the script claims: KL against a reference, at most 8 new tokens
    trl_rows = json.loads((tmp_path / "tiny" / "trl" / "trl_steps.json").read_text())
    assert len(trl_rows) == 2
    assert all("kl" in r["logs"] and r["logs"]["completions/max_length"] <= 8 for r in trl_rows)
    # both sides started from the saved model, and verl_ds trained GRPO with the KL in the loss
    with open(tmp_path / "tiny" / "verl_ds_z0" / "metrics.jsonl", encoding="utf-8") as fh:
        metrics = [json.loads(ln) for ln in fh]
    steps = [m for m in metrics if "timing_s/step" in m]
    assert len(steps) == 2 and all("actor/kl_loss" in m and "critic/vf_loss" not in m for m in steps)
    cpu = json.loads((tmp_path / "tiny" / "verl_ds_z0" / "cpu_s.json").read_text())
    assert len(cpu) == 2 and all(c["cpu_s"] >= c["cpu_gen"] + c["cpu_update_actor"] > 0 for c in cpu)


def test_the_wide_vocabulary_of_the_long_regime():
    mod = _load()
    words = mod.wide_vocab(2044)
    assert len(words) == len(set(words)) == 2044
    assert {"even", "odd", "=>", ":"} | {str(d) for d in range(10)} <= set(words)  # the task's prompts encode
    assert all(w and not any(c.isspace() for c in w) for w in words)


@pytest.mark.timeout(1500)  # two training processes with 24-token responses
def test_both_sides_run_the_long_diverse_regime_at_the_smallest_size(tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (optional benchmark dependency, setup.py extra 'bench')")
    cmd = [sys.executable, SCRIPT, "--regime", "long_diverse", "--sizes", "tiny", "--steps-tiny", "2", "--warmup",
           "1", "--zero-stages", "0", "--prompts-per-step", "2", "--n", "2", "--micro-batch", "2", "--max-new-tokens",
           "24", "--threads", "1", "--timeout", "600", "--work-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = {ln.split()[1]: ln.split() for ln in lines if ln.startswith("tiny:long ") and len(ln.split()) >= 8}
    assert set(table) == {"trl", "verl_ds"}, proc.stdout
    figures = dict(kv.split("=") for kv in re.fullmatch(r"e2e_vs_trl (.*)", lines[-1]).group(1).split())
    assert {"long_tiny_step_ratio", "long_tiny_tokens_per_s_ratio", "long_tiny_shared_prefix_share"} <= set(figures)
    assert not any(k.startswith("tiny_") for k in figures)
    # diverse: samples of a prompt share (almost) no response prefix; long: a fresh model over 2,048 words rarely
    # draws EOS, so responses run to the limit on both sides (over the task's 18 tokens they end after ~12)
    assert float(figures["long_tiny_shared_prefix_share"]) < 0.2
    run = tmp_path / "long_diverse" / "tiny"
    trl_rows = json.loads((run / "trl" / "trl_steps.json").read_text())
    assert all(18 <= r["logs"]["completions/mean_length"] <= 24 for r in trl_rows)
    with open(run / "verl_ds_z0" / "metrics.jsonl", encoding="utf-8") as fh:
        steps = [m for m in map(json.loads, fh) if "timing_s/step" in m]
    assert len(steps) == 2 and all(18 <= m["response_length/mean"] <= 24 for m in steps)
    with open(run / "model_tiny" / "config.json", encoding="utf-8") as fh:
        assert json.load(fh)["vocab_size"] == 2048
