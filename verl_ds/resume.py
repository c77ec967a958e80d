"""How a job finds the checkpoint to resume from: ``trainer.resume`` auto (the newest that verifies, else an older
one), a directory, or none; and the one fall-back after a resume (docs/reliability.md, "Crash safety"). ``job`` is
a ``verl_ds.runtime.job.Job``: its ``restore`` loads one."""
from __future__ import annotations

import logging
import os
from typing import Optional

from verl_ds import checkpoint as ckpt
from verl_ds import dist as vdist
from verl_ds.checkpoint_manifest import read_manifest
from verl_ds.step_boundary import AUDIT_FILE, JOURNAL_FILE

log = logging.getLogger(__name__)


def verify_mode(step_dir: str) -> str:
    """Whole-file digests ("full") when ``step_dir`` has them, else each file's first and last MiB ("edges")."""
    manifest, _ = read_manifest(step_dir)  # an unreadable manifest fails the check itself, with its reason
    return "full" if manifest is not None and manifest.get("sha256") else "edges"


def _resume_first_sound(job, candidates: list, skipped: list) -> Optional[int]:
    """Resume from the first of ``candidates`` that verifies on every rank (collective); the step, or None."""
    for step_dir in candidates:
        mode = verify_mode(step_dir)
        reason = ckpt.verify_distributed(step_dir, mode)
        if reason is None:
            return job.restore(step_dir, verify=False)
        if job.is_main:
            log.warning("skipping checkpoint %s: %s (checked: %s); trying the previous one", step_dir, reason, mode)
        skipped.append((step_dir, reason))
    return None


def _refuse_to_start_over(job, skipped: list) -> None:
    """Every checkpoint that a save completed is damaged: starting at step 0 would silently throw the run away."""
    complete = [(d, why) for d, why in skipped if os.path.isfile(os.path.join(d, ckpt.MANIFEST))]
    if complete:
        listed = "; ".join(f"{d}: {why}" for d, why in complete)
        raise ckpt.CheckpointError(
            f"trainer.resume=auto: none of the {len(complete)} complete checkpoint(s) in {job.ckpt_root} can be "
            f"resumed ({listed}). Not starting over at step 0: restore a checkpoint, resume one explicitly "
            f"(trainer.resume=<dir>), or start fresh on purpose with trainer.resume=none")


def maybe_resume(job) -> int:
    """Resume per ``trainer.resume`` (auto: the newest complete checkpoint that verifies, else an older one; refused
    when all are damaged); returns the step (0: fresh)."""
    mode = job.cfg.trainer.resume
    if mode not in ("auto", "none"):
        return job.restore(mode)
    if mode == "auto":
        found = ckpt.scan(job.ckpt_root) if job.is_main else None
        candidates, skipped = vdist.broadcast_object(found)
        step = _resume_first_sound(job, candidates, skipped)
        if step is not None:
            return step
        _refuse_to_start_over(job, skipped)
    if job.is_main:  # a fresh run in a used directory: the previous run's logs must not mix in, nor be lost
        for name in ("metrics.jsonl", AUDIT_FILE, JOURNAL_FILE):
            path = os.path.join(job.out_dir, name)
            if os.path.isfile(path):
                os.replace(path, path + ".prev")
                log.info("fresh start in %s: the previous run's %s is kept as %s.prev", job.out_dir, name, name)
    vdist.barrier()
    return 0


def fall_back_after_resume(job, step: int, resumed: int) -> bool:
    """Non-finite steps soon after a resume (damage the digests missed): resume from the previous checkpoint."""
    if not resumed or step - resumed > 2 * job.cfg.trainer.max_bad_steps:
        return False
    found = ckpt.scan(job.ckpt_root) if job.is_main else None
    candidates, _ = vdist.broadcast_object(found)
    earlier = [d for d in candidates if ckpt.step_of(d) < resumed]
    if not earlier:
        return False
    log.warning("step %d: non-finite values right after resuming from step %d: falling back once to the previous "
                "complete checkpoint %s", step, resumed, earlier[0])
    return _resume_first_sound(job, earlier, []) is not None
