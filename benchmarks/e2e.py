"""End-to-end PPO throughput: the default job and a larger tiny model, gathered vs per-token generation.

Runs ``launch/train.py`` (ZeRO-3, world size 1 unless --nproc) for a few steps per case and reads the
per-step timings the trainer logs (``timing_s/*``). The first steps are warm-up and dropped.

    python benchmarks/e2e.py               # ~3-5 min on 2 CPU cores
    python benchmarks/e2e.py --steps 6 --nproc 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "default job (h64 L2)": [],
    "larger tiny model (h256 L4)": ["model.hidden_size=256", "model.intermediate_size=768", "model.num_layers=4",
                                    "model.num_heads=8", "model.num_kv_heads=4"],
}
PHASES = {"gen": ["timing_s/gen"], "log-probs/values": ["timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv"],
          "update": ["timing_s/update_actor", "timing_s/update_critic"]}


def run_case(overrides: list, steps: int, nproc: int, threads: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix="verl_ds_bench_")
    args = [f"trainer.output_dir={out}", "trainer.resume=none", f"trainer.total_steps={steps}", "trainer.progress_bar=false",
            "trainer.plot=false", "trainer.export_hf=false", "trainer.val_every=0", *overrides]
    train = os.path.join(ROOT, "launch", "train.py")
    cmd = [sys.executable, train, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", train, *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return [m for m in map(json.loads, fh) if "timing_s/step" in m]


def summarise(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:] or rows
    med = lambda keys: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)  # noqa: E731
    step = med(["timing_s/step"])
    return {"step_s": step, "steps_per_s": 1.0 / step, "tokens_per_s": statistics.median(r["perf/throughput"] for r in rows),
            **{name: med(keys) for name, keys in PHASES.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = p.parse_args()
    print(f"verl_ds e2e benchmark: ZeRO-3, {args.nproc} rank(s), OMP_NUM_THREADS={args.threads}, {args.steps} steps per case "
          f"(median over steps after {args.warmup} warm-up), CPU")
    header = f"{'case':44s} {'step s':>7s} {'steps/s':>8s} {'tok/s':>8s} {'gen s':>7s} {'lp/val s':>9s} {'update s':>9s}"
    print(header)
    print("-" * len(header))
    results = {}
    for name, overrides in CASES.items():
        for gather in (True, False):
            label = f"{name}, {'gathered' if gather else 'per-token'} gen"
            t0 = time.perf_counter()
            s = summarise(run_case([*overrides, f"rollout.gather_params={str(gather).lower()}"], args.steps, args.nproc,
                                   args.threads), args.warmup)
            results[label] = s
            print(f"{label:44s} {s['step_s']:7.3f} {s['steps_per_s']:8.2f} {s['tokens_per_s']:8.0f} {s['gen']:7.3f} "
                  f"{s['log-probs/values']:9.3f} {s['update']:9.3f}   ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    print()
    for name in CASES:
        g, t = results[f"{name}, gathered gen"], results[f"{name}, per-token gen"]
        print(f"{name}: generation with gathered parameters is {t['gen'] / g['gen']:.1f}x faster than per-token "
              f"gathering; the whole step {t['step_s'] / g['step_s']:.2f}x")


if __name__ == "__main__":
    main()
