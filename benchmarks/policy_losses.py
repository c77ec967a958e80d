"""GRPO on the built-in task with each policy loss (``algo.policy_loss``, docs/algorithms.md): the parity score of
the first vs the last 10% of the steps, per seed and averaged, each loss beside the default ``vanilla``::

    python benchmarks/policy_losses.py                        # vanilla, gspo, gmpo, cispo; seeds 0-2; 150 steps
    python benchmarks/policy_losses.py --losses sapo --seeds 0 -- trainer.total_steps=50

Each loss runs with the clip values its paper uses (``CLIPS``). Lines::

    policy_loss_seed loss=gspo seed=0 score_first=... score_last=... seconds=...
    policy_loss loss=gspo score_first=... score_last=... seconds=... seeds=3 learns=True

``learns``: every seed's last 10% scores at least ``--min-rise`` above its first 10%. Exit 1 when a loss does not.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distill import first_last, train  # noqa: E402 - one launcher of runs for the benchmark scripts

# GRPO as benchmarks/async_rl.py runs it on the built-in task: 16 prompts x 4 samples, one optimizer step per batch
GRPO = ("algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=16", "actor.mini_batch_size=64",
        "trainer.val_every=0", "trainer.loggers=[]", "trainer.resume=none")
CLIPS = {  # the papers' clip ranges (docs/algorithms.md)
    "vanilla": (),
    "gspo": ("algo.clip_ratio_low=3e-4", "algo.clip_ratio_high=4e-4"),
    "gmpo": ("algo.clip_ratio_low=0.4", "algo.clip_ratio_high=0.4"),
    "cispo": ("algo.clip_ratio_low=0.99", "algo.clip_ratio_high=0.28"),  # bounded above only, as MiniMax-M1
    "sapo": (),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", default="vanilla,gspo,gmpo,cispo", help=f"comma-separated, of {', '.join(CLIPS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--min-rise", type=float, default=0.2, help="last 10%% minus first 10%% needed to count as learning")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--work-dir", default=None, help="where the runs go (default: a new temporary directory)")
    ap.add_argument("overrides", nargs="*", help="overrides for every run after --, e.g. trainer.total_steps=50")
    args = ap.parse_args(argv)
    losses = [x for x in args.losses.split(",") if x]
    unknown = [x for x in losses if x not in CLIPS]
    if unknown:
        ap.error(f"--losses: unknown {', '.join(unknown)}; known: {', '.join(CLIPS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    work = tempfile.mkdtemp(prefix="verl_ds_policy_losses_", dir=args.work_dir)
    all_learn = True
    for loss in losses:
        rows = []
        for seed in seeds:
            out = os.path.join(work, f"{loss}_seed{seed}")
            seconds = train(out, [*GRPO, f"algo.policy_loss={loss}", *CLIPS[loss], f"trainer.seed={seed}",
                                  *args.overrides], args.timeout_s)
            first, last = first_last(os.path.join(out, "metrics.jsonl"))
            rows.append((first, last, seconds))
            print(f"policy_loss_seed loss={loss} seed={seed} score_first={first:.3f} score_last={last:.3f} "
                  f"seconds={seconds:.1f}", flush=True)
        learns = all(last - first >= args.min_rise for first, last, _ in rows)
        all_learn &= learns
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(3)]
        print(f"policy_loss loss={loss} score_first={mean[0]:.3f} score_last={mean[1]:.3f} seconds={mean[2]:.1f} "
              f"seeds={len(rows)} learns={learns}", flush=True)
    return 0 if all_learn else 1


if __name__ == "__main__":
    sys.exit(main())
