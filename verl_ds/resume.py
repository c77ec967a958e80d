"""Checkpoint contents and resuming: what a run saves beyond the engines, and how it comes back.

A checkpoint holds the engines (weights, optimizer, every rank's RNG: ``verl_ds.checkpoint``) and this trainer
state: SharedState, each registered model's ``state_dict()`` (the KL controller lives in the PPOModel's), the
registry versions, the active reward spec (a hot-swapped reward is rebuilt on resume), the data sampler and the
non-finite guard. The hot values in the checkpoint win over the config, as for any SharedState key: each key
where the config disagrees is logged once.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from verl_ds import checkpoint as ckpt
from verl_ds import dist as vdist
from verl_ds.control import AUDIT_FILE, JOURNAL_FILE

log = logging.getLogger(__name__)


def trainer_state(trainer) -> dict:
    reg = trainer.registry
    return {"shared_state": trainer.state.state_dict(), "global_step": trainer.state.get("global_step"),
            "models": {name: reg.get(name).state_dict() for name in reg.names()},
            "registry_versions": reg.versions(), "reward_spec": trainer.boundary.reward_spec,
            "sampler": trainer.c.sampler.state_dict(), "reliability": trainer.guard.state_dict()}


def save_checkpoint(trainer) -> str:
    """A complete checkpoint of the current step (collective); the checkpoint's points reach the listeners."""
    step = trainer.state.get("global_step")
    return ckpt.save(trainer.ckpt_root, step, trainer.c.engines, trainer_state(trainer),
                     keep_last=trainer.cfg.trainer.keep_last, on_event=lambda point: trainer._emit(point, step),
                     digest=trainer.cfg.trainer.checkpoint_digest)


def resume_from(trainer, step_dir: str) -> int:
    """Restore everything from ``step_dir`` (collective); returns its step."""
    from verl_ds.config import initial_state

    # another world size is fine (DeepSpeed's universal checkpoint; data order and RNG policy: verl_ds.checkpoint)
    saved = ckpt.load(step_dir, trainer.c.engines, verify=trainer.cfg.trainer.verify_checkpoint,
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
    step = int(saved["global_step"])
    trainer.metrics.truncate_after(step)
    trainer.boundary.schedule_replay(step)
    if trainer.is_main:
        log.info("resumed from %s (step %d)", step_dir, step)
    return step


def maybe_resume(trainer) -> int:
    """Resume per ``trainer.resume`` (auto: the latest complete checkpoint); returns the step (0: fresh start)."""
    mode = trainer.cfg.trainer.resume
    step_dir = None
    if mode != "none":
        step_dir = ckpt.find_resumable(trainer.ckpt_root) if mode == "auto" else mode
        step_dir = vdist.broadcast_object(step_dir)
    if step_dir is not None:
        return resume_from(trainer, step_dir)
    if trainer.is_main:  # a fresh run in a used directory: the previous run's logs must not mix in, nor be lost
        for name in ("metrics.jsonl", AUDIT_FILE, JOURNAL_FILE):
            path = os.path.join(trainer.out_dir, name)
            if os.path.isfile(path):
                os.replace(path, path + ".prev")
                log.info("fresh start in %s: the previous run's %s is kept as %s.prev", trainer.out_dir, name, name)
    vdist.barrier()
    return 0


def previous_checkpoint(trainer, before_step: int) -> Optional[str]:
    """The newest complete checkpoint older than ``before_step`` (the same answer on every rank), or None."""
    found = None
    if trainer.is_main and os.path.isdir(trainer.ckpt_root):
        steps = sorted((ckpt.step_of(n), n) for n in os.listdir(trainer.ckpt_root) if n.startswith("global_step_"))
        for step, name in reversed(steps):
            path = os.path.join(trainer.ckpt_root, name)
            if step < before_step and ckpt.verify(path) is None:
                found = path
                break
    return vdist.broadcast_object(found)


def fall_back_after_resume(trainer, step: int, resumed: int) -> bool:
    """Non-finite steps within a few steps of resuming from ``resumed`` (a checkpoint damaged where its digests do
    not look, say): resume from the previous complete checkpoint instead (collective); False when there is none
    or the run is past that window."""
    if not resumed or step - resumed > 2 * trainer.cfg.trainer.max_bad_steps:
        return False
    earlier = previous_checkpoint(trainer, resumed)
    if earlier is None:
        return False
    log.warning("step %d: non-finite values right after resuming from step %d: falling back once to the previous "
                "complete checkpoint %s", step, resumed, earlier)
    resume_from(trainer, earlier)
    return True
