"""What a checkpoint holds beyond the engines (SharedState, model states, the active reward, the sampler, the
non-finite guard) and how a run resumes from it (docs/reliability.md, "Crash safety")."""
from __future__ import annotations

import logging
import os
from typing import Optional

from verl_ds import checkpoint as ckpt
from verl_ds import dist as vdist
from verl_ds.checkpoint_manifest import read_manifest
from verl_ds.step_boundary import AUDIT_FILE, JOURNAL_FILE

log = logging.getLogger(__name__)


def trainer_state(trainer) -> dict:
    reg = trainer.registry
    return {"shared_state": trainer.state.state_dict(), "global_step": trainer.state.get("global_step"),
            "models": {name: reg.get(name).state_dict() for name in reg.names()},
            "registry_versions": reg.versions(), "reward_spec": trainer.boundary.reward_spec,
            "sampler": trainer.c.sampler.state_dict(), "reliability": trainer.guard.state_dict(),
            # rollout.mode one_step_off / streaming: every rank's queue and prompts in flight (a collective)
            **({"async": trainer.asyncrl.state_dict()} if getattr(trainer, "asyncrl", None) else {})}


def save_checkpoint(trainer) -> str:
    """A complete checkpoint of the current step (collective); the checkpoint's points reach the listeners."""
    step = trainer.state.get("global_step")
    return ckpt.save(trainer.ckpt_root, step, trainer.c.engines, trainer_state(trainer),
                     keep_last=trainer.cfg.trainer.keep_last, on_event=lambda point: trainer._emit(point, step),
                     digest=trainer.cfg.trainer.checkpoint_digest)


def resume_from(trainer, step_dir: str, verify: bool = True) -> int:
    """Restore everything from ``step_dir`` (collective; ``verify=False``: the caller verified it); returns its step."""
    from verl_ds.resolved_config import initial_state

    # another world size is fine (DeepSpeed's universal checkpoint; data order and RNG policy: verl_ds.checkpoint)
    saved = ckpt.load(step_dir, trainer.c.engines, verify=verify_mode(step_dir) if verify else None,
                      seed=trainer.cfg.trainer.seed)
    st = trainer.state
    st.load_state_dict(saved["shared_state"])
    if trainer.is_main:
        for key, value in initial_state(trainer.cfg).items():
            if st.get(key) != value:
                log.info("resume: %s = %r from the checkpoint (a hot value) wins over the config's %r", key,
                         st.get(key), value)
    spec = saved.get("reward_spec")
    if spec and spec != trainer.boundary.reward_spec:  # a reward swapped over HTTP before the checkpoint
        if trainer.is_main:
            log.info("resume: the reward active at the checkpoint (%s) wins over the config's", spec)
        trainer.boundary.restore(spec)  # checked and tried like a swap: one that fails now is refused, not fatal
    for name, sd in saved["models"].items():
        if name in trainer.registry:
            trainer.registry.get(name).load_state_dict(sd)
    trainer.registry.restore_versions({k: v for k, v in saved["registry_versions"].items() if k in trainer.registry})
    trainer.c.sampler.load_state_dict(saved["sampler"])
    trainer.guard.load_state_dict(saved.get("reliability", {}))
    if getattr(trainer, "asyncrl", None) is not None and "async" in saved:
        trainer.asyncrl.load_state_dict(saved["async"])
    # the generation replica still holds the weights it last copied (a fallback replaced them): copy them again
    trainer.registry.get("actor").rollout_engine.refresh()
    step = int(saved["global_step"])
    trainer.metrics.truncate_after(step)
    trainer.boundary.schedule_replay(step)
    if trainer.is_main:
        log.info("resumed from %s (step %d)", step_dir, step)
    return step


def verify_mode(step_dir: str) -> str:
    """Whole-file digests ("full") when ``step_dir`` has them, else each file's first and last MiB ("edges")."""
    manifest, _ = read_manifest(step_dir)  # an unreadable manifest fails the check itself, with its reason
    return "full" if manifest is not None and manifest.get("sha256") else "edges"


def _resume_first_sound(trainer, candidates: list, skipped: list, restore=None) -> Optional[int]:
    """Resume from the first of ``candidates`` that verifies on every rank (collective); the step, or None."""
    for step_dir in candidates:
        mode = verify_mode(step_dir)
        reason = ckpt.verify_distributed(step_dir, mode)
        if reason is None:
            return (restore or resume_from)(trainer, step_dir, verify=False)
        if trainer.is_main:
            log.warning("skipping checkpoint %s: %s (checked: %s); trying the previous one", step_dir, reason, mode)
        skipped.append((step_dir, reason))
    return None


def _refuse_to_start_over(trainer, skipped: list) -> None:
    """Every checkpoint that a save completed is damaged: starting at step 0 would silently throw the run away."""
    complete = [(d, why) for d, why in skipped if os.path.isfile(os.path.join(d, ckpt.MANIFEST))]
    if complete:
        listed = "; ".join(f"{d}: {why}" for d, why in complete)
        raise ckpt.CheckpointError(
            f"trainer.resume=auto: none of the {len(complete)} complete checkpoint(s) in {trainer.ckpt_root} can be "
            f"resumed ({listed}). Not starting over at step 0: restore a checkpoint, resume one explicitly "
            f"(trainer.resume=<dir>), or start fresh on purpose with trainer.resume=none")


def maybe_resume(trainer, restore=None) -> int:
    """Resume per ``trainer.resume`` (auto: the newest complete checkpoint that verifies, else an older one; refused
    when all are damaged); returns the step (0: fresh). ``restore`` loads one (``verl_ds.stages`` pass their own)."""
    restore = restore or resume_from
    mode = trainer.cfg.trainer.resume
    if mode not in ("auto", "none"):
        return restore(trainer, mode)
    if mode == "auto":
        found = ckpt.scan(trainer.ckpt_root) if trainer.is_main else None
        candidates, skipped = vdist.broadcast_object(found)
        step = _resume_first_sound(trainer, candidates, skipped, restore)
        if step is not None:
            return step
        _refuse_to_start_over(trainer, skipped)
    if trainer.is_main:  # a fresh run in a used directory: the previous run's logs must not mix in, nor be lost
        for name in ("metrics.jsonl", AUDIT_FILE, JOURNAL_FILE):
            path = os.path.join(trainer.out_dir, name)
            if os.path.isfile(path):
                os.replace(path, path + ".prev")
                log.info("fresh start in %s: the previous run's %s is kept as %s.prev", trainer.out_dir, name, name)
    vdist.barrier()
    return 0


def fall_back_after_resume(trainer, step: int, resumed: int) -> bool:
    """Non-finite steps soon after a resume (damage the digests missed): resume from the previous checkpoint."""
    if not resumed or step - resumed > 2 * trainer.cfg.trainer.max_bad_steps:
        return False
    found = ckpt.scan(trainer.ckpt_root) if trainer.is_main else None
    candidates, _ = vdist.broadcast_object(found)
    earlier = [d for d in candidates if ckpt.step_of(d) < resumed]
    if not earlier:
        return False
    log.warning("step %d: non-finite values right after resuming from step %d: falling back once to the previous "
                "complete checkpoint %s", step, resumed, earlier[0])
    return _resume_first_sound(trainer, earlier, []) is not None
