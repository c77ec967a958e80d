"""The learning check of the built-in agent tasks: a config (default configs/agent_calc.yaml) trained on seeds 0-2,
one ``launch/train.py`` subprocess each, one after the other; per seed the first and last 10% of steps of
``agent/tool_call_rate`` and ``rollout/score/mean`` from its metrics.jsonl, then a summary (means over the seeds)::

    python benchmarks/agent_learning.py --config configs/agent_calc.yaml
    python benchmarks/agent_learning.py --config configs/agent_guess.yaml --seeds 0 1 2 -- trainer.total_steps=80
    python benchmarks/agent_learning.py --ppo     # PPO with a critic: configs/agent_calc_ppo.yaml's algo settings

``--ppo`` trains the config with PPO_OVERRIDES (GAE with a critic, lam 1, no advantage whitening: the algo section of
configs/agent_calc_ppo.yaml, which is agent_calc.yaml with them); a key also given on the command line takes the
command line's value.

A seed passes when the score's last 10% exceeds its first 10% by at least ``--min-gain`` and, for a task with
tools, the last 10%'s tool-call rate is above ``--min-tool-rate``; the exit status is 1 when a seed does not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO_OVERRIDES = ("algo.adv_estimator=gae", "algo.lam=1.0", "algo.whiten_advantages=false")


def overrides_for(ppo: bool, given: list) -> list:
    """The overrides every seed trains with: ``given``, after PPO_OVERRIDES (less the keys ``given`` sets) when
    ``ppo``."""
    keys = {o.split("=", 1)[0] for o in given}
    return [*(o for o in PPO_OVERRIDES if ppo and o.split("=", 1)[0] not in keys), *given]


def first_last(values: list) -> tuple[float, float]:
    """Means of the first and the last 10% (at least one value each)."""
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def read_curves(metrics_path: str) -> dict:
    """Per-step ``agent/tool_call_rate`` and ``rollout/score/mean`` of a run, in step order (last record wins)."""
    steps = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "rollout/score/mean" in rec:
                steps[rec["step"]] = rec
    ordered = [steps[s] for s in sorted(steps)]
    return {"tool_call_rate": [r.get("agent/tool_call_rate", 0.0) for r in ordered],
            "score": [r["rollout/score/mean"] for r in ordered]}


def run_seed(config: str, seed: int, out_dir: str, overrides: list, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config", config, f"trainer.seed={seed}",
           f"trainer.output_dir={out_dir}", "trainer.resume=none", *overrides]
    start = time.time()
    with open(os.path.join(os.path.dirname(out_dir), f"seed{seed}.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    seconds = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: launch/train.py exited {proc.returncode}; log: {log.name}")
    curves = read_curves(os.path.join(out_dir, "metrics.jsonl"))
    rate_first, rate_last = first_last(curves["tool_call_rate"])
    score_first, score_last = first_last(curves["score"])
    return {"seed": seed, "steps": len(curves["score"]), "tool_call_rate_first": rate_first,
            "tool_call_rate_last": rate_last, "score_first": score_first, "score_last": score_last,
            "seconds": seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "agent_calc.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--min-gain", type=float, default=0.3, help="score: last 10%% - first 10%% at least this")
    ap.add_argument("--min-tool-rate", type=float, default=0.8, help="tool-call rate of the last 10%% above this "
                    "(tasks with tools)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--ppo", action="store_true", help="PPO with a critic (PPO_OVERRIDES) instead of the config's "
                    "estimator")
    ap.add_argument("--out", default=None, help="runs go here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every seed (key=value)")
    args = ap.parse_args(argv)
    overrides = overrides_for(args.ppo, args.overrides)
    import yaml

    with open(args.config, encoding="utf-8") as f:
        tree = yaml.safe_load(f) or {}
    task = (tree.get("agent") or {}).get("environment") or "?"
    algo = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("algo.adv_estimator=")),
                (tree.get("algo") or {}).get("adv_estimator") or "?")
    has_tools = task == "calc"
    base = args.out or tempfile.mkdtemp(prefix="agent_learning_")
    os.makedirs(base, exist_ok=True)
    results, ok = [], True
    for seed in args.seeds:
        r = run_seed(args.config, seed, os.path.join(base, f"seed{seed}"), overrides, args.timeout_s)
        passed = r["score_last"] - r["score_first"] >= args.min_gain and (
            not has_tools or r["tool_call_rate_last"] > args.min_tool_rate)
        ok &= passed
        results.append(r)
        print(f"agent_learning_seed task={task} algo={algo} seed={seed} steps={r['steps']} "
              f"tool_call_rate_first={r['tool_call_rate_first']:.3f} tool_call_rate_last={r['tool_call_rate_last']:.3f} "
              f"score_first={r['score_first']:.3f} score_last={r['score_last']:.3f} seconds={r['seconds']:.0f} "
              f"pass={passed}", flush=True)
    mean = {k: sum(r[k] for r in results) / len(results) for k in
            ("tool_call_rate_first", "tool_call_rate_last", "score_first", "score_last", "seconds")}
    print(f"agent_learning task={task} algo={algo} tool_call_rate_first={mean['tool_call_rate_first']:.3f} "
          f"tool_call_rate_last={mean['tool_call_rate_last']:.3f} score_first={mean['score_first']:.3f} "
          f"score_last={mean['score_last']:.3f} seconds={mean['seconds']:.0f} seeds={len(results)} "
          f"all_pass={ok} runs={base}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
