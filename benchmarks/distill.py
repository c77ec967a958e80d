"""On-policy distillation on the built-in task: the actor ``make run`` exports teaches a freshly built tiny student
with no reward function; the student's parity score (the task's rule, logged at weight 0 as ``reward/parity/mean``)
is compared between the first and the last 10% of its steps (docs/stages.md, "On-policy distillation")::

    python benchmarks/distill.py                                  # teacher: runs/default/hf_actor, trained if absent
    python benchmarks/distill.py --teacher runs/default/hf_actor -- trainer.total_steps=300 actor.lr=1e-2

It prints one line ``distill score_first=... score_last=... seconds=...`` (seconds: the student's run) and exits 1 when
score_last is below ``--min-score``.
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
STUDENT = ("reward.functions=[]", "algo.adv_estimator=reinforce_plus_plus", "actor.lr=5e-3", "trainer.val_every=0",
           "trainer.loggers=[]", "trainer.resume=none")


def train(out_dir: str, overrides: list, timeout_s: float) -> float:
    """One launch/train.py run into ``out_dir``; returns its wall seconds (SystemExit naming the log on failure)."""
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), f"trainer.output_dir={out_dir}", *overrides]
    start = time.time()
    with open(out_dir + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"launch/train.py exited {proc.returncode}; log: {log.name}")
    return time.time() - start


def first_last(metrics_path: str, key: str = "reward/parity/mean") -> tuple[float, float]:
    """Means of ``key`` over the first and the last 10% of the steps (at least one each)."""
    steps = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if key in rec:
                steps[rec["step"]] = rec[key]
    values = [steps[s] for s in sorted(steps)]
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default=os.path.join(ROOT, "runs", "default", "hf_actor"),
                    help="HF directory of the teacher; absent: the default job (make run) is trained to make it")
    ap.add_argument("--min-score", type=float, default=0.8, help="score_last at least this")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--work-dir", default=None, help="where the runs go (default: a new temporary directory)")
    ap.add_argument("overrides", nargs="*", help="student overrides after --, e.g. trainer.total_steps=300")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="verl_ds_distill_", dir=args.work_dir)
    teacher = args.teacher
    if not os.path.isdir(teacher):
        train(os.path.join(work, "teacher"), ["trainer.loggers=[]"], args.timeout_s)  # make run's job
        teacher = os.path.join(work, "teacher", "hf_actor")
    student = os.path.join(work, "student")
    given = {o.split("=", 1)[0] for o in args.overrides}  # a key given on the command line replaces STUDENT's
    base = [o for o in (*STUDENT, f"distill.teacher_path={teacher}") if o.split("=", 1)[0] not in given]
    seconds = train(student, [*base, *args.overrides], args.timeout_s)
    first, last = first_last(os.path.join(student, "metrics.jsonl"))
    print(f"distill score_first={first:.3f} score_last={last:.3f} seconds={seconds:.1f}")
    return 0 if last >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
