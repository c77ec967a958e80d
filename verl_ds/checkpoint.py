"""Checkpoints that resume exactly, at the same or another world size, and never become ``latest`` half-written: the
``COMPLETE`` manifest goes after every rank's files, ``latest`` last. Layout, checks at resume, the trust boundary and
the elastic resume: docs/reliability.md, "Crash safety" and "Trust model"."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import resource
import shutil
from typing import Callable, Optional

import numpy as np
import torch

from verl_ds import dist as vdist
from verl_ds import safe_state
from verl_ds.checkpoint_manifest import (BLOCK as _BLOCK, CONVERTED, MANIFEST, STEP_DIR as _STEP_DIR, VERIFY_MODES,  # noqa: F401
                                         CheckpointDamaged, CheckpointError, edge_digest, find_resumable, fsync_dir,
                                         fsync_write, full_digest, list_files as _manifest, read_manifest as _read_manifest,
                                         scan, share as _share, step_of, verify, verify_distributed)

log = logging.getLogger(__name__)

TAG = "state"
FORMAT = 2  # 2: trainer and RNG states as JSON + safetensors; 1 (no "format" in the manifest): pickles


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(step_dir: str) -> None:
    for root, _, names in os.walk(step_dir):
        for name in names:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)


def _trained(engines: dict) -> dict:
    """The engines a checkpoint holds: those with an optimizer (frozen ones are rebuilt from the model)."""
    if not isinstance(engines, dict) or not engines:
        raise TypeError(f"engines: expected a non-empty mapping role -> DeepSpeed engine, got {engines!r}")
    # a frozen ZeRO-3 engine still has an ``optimizer`` (DeepSpeed's parameter offload helper), never a basic one
    return {role: e for role, e in engines.items() if getattr(e, "basic_optimizer", None) is not None}


def _has_frozen(engine) -> bool:
    return any(not p.requires_grad for p in engine.module.parameters())


def trainable_signature(engine) -> dict:
    """Count, size and a digest of the names and shapes of an engine's trainable parameters, and whether it has a
    frozen base: a resume with other LoRA keys is refused."""
    h, tensors, numel = hashlib.sha256(), 0, 0
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            shape = tuple(getattr(p, "ds_shape", p.shape))
            h.update(f"{name}:{shape};".encode())
            tensors, numel = tensors + 1, numel + int(np.prod(shape, dtype=np.int64))
    return {"tensors": tensors, "numel": numel, "digest": h.hexdigest()[:16], "frozen_base": _has_frozen(engine)}


def _describe_trainable(sig: dict) -> str:
    base = "adapters on a frozen base" if sig.get("frozen_base") else "every weight"
    return f"{sig.get('tensors')} tensors, {sig.get('numel')} parameters ({base})"


def _zero_stage(engine) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def save(ckpt_root: str, step: int, engines: dict, trainer_state: dict, keep_last: int,
         on_event: Optional[Callable[[str], None]] = None, digest: str = "full") -> str:
    """Save a complete checkpoint of the engines (role -> engine) that have an optimizer; collective, returns its
    directory. ``on_event(point)``: "after_<role>", "before_manifest", "before_latest" (for fault injection).
    ``digest``: "full" (sha256 of every file, hashed over the ranks) or "edges" (each file's ends only)."""
    if digest not in ("edges", "full"):
        raise ValueError(f"digest: expected 'edges' or 'full', got {digest!r}")
    trained = _trained(engines)
    name = f"global_step_{step}"
    step_dir = os.path.join(ckpt_root, name)
    hook = on_event or (lambda point: None)
    if vdist.rank() == 0:
        if os.path.isdir(step_dir):  # an incomplete leftover from a killed run: never mix files of two saves
            shutil.rmtree(step_dir)
        os.makedirs(step_dir, exist_ok=True)
    vdist.barrier()
    from verl_ds.engines.universal import client_state

    with _explain_disk_errors(ckpt_root, step_dir):
        for role, engine in trained.items():  # a frozen base (LoRA) is rebuilt from the model, never saved
            engine.save_checkpoint(os.path.join(step_dir, role), tag=TAG, save_latest=False,
                                   client_state=client_state(), exclude_frozen_parameters=_has_frozen(engine))
            hook(f"after_{role}")
        safe_state.dump(rng_state(), os.path.join(step_dir, f"rng_rank{vdist.rank()}.json"), fsync_write)
        if vdist.rank() == 0:  # exact and readable: JSON (tensors, if a model's state has any, in safetensors)
            safe_state.dump(trainer_state, os.path.join(step_dir, "trainer_state.json"), fsync_write)
    vdist.barrier()
    files = _manifest(step_dir, trained) if vdist.rank() == 0 else None
    files = vdist.broadcast_object(files)
    full = {}
    if digest == "full":  # each rank hashes its share of the bytes; rank 0 collects
        for part in vdist.gather_object({rel: full_digest(os.path.join(step_dir, rel))
                                         for rel in _share(files, vdist.rank(), vdist.world_size())}):
            full.update(part)
    if vdist.rank() == 0:
        with _explain_disk_errors(ckpt_root, step_dir):
            _fsync_tree(step_dir)
            hook("before_manifest")
            manifest = {"format": FORMAT, "step": step, "world_size": vdist.world_size(), "roles": list(trained),
                        "zero_stage": {role: _zero_stage(e) for role, e in trained.items()},
                        "trainable": {role: trainable_signature(e) for role, e in trained.items()}, "files": files,
                        "digests": {rel: edge_digest(os.path.join(step_dir, rel)) for rel in files}}
            if full:
                manifest["sha256"] = full
            fsync_write(os.path.join(step_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
            hook("before_latest")
            fsync_write(os.path.join(ckpt_root, "latest"), name.encode())
        _prune(ckpt_root, keep_last)
    vdist.barrier()
    return step_dir


def _prune(ckpt_root: str, keep_last: int) -> None:
    complete = sorted((n for n in os.listdir(ckpt_root) if _STEP_DIR.match(n)
                       and verify(os.path.join(ckpt_root, n), mode="sizes") is None),
                      key=lambda n: int(_STEP_DIR.match(n).group(1)))
    for name in complete[:-keep_last]:
        shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)


def derived_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank with no saved RNG (resuming at a larger world size)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little") % 2**63


def _read_states(step_dir: str, manifest: dict) -> tuple:
    """(trainer state, this rank's RNG state or None), read as data only (JSON + safetensors, or format 1 through
    torch's restricted unpickler): nothing in them can run code."""
    fmt = manifest.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise CheckpointError(f"{step_dir} was written in checkpoint format {fmt!r} by a newer verl_ds (this one reads "
                              f"formats 1-{FORMAT}); resume it with that version")
    rng_name = f"rng_rank{vdist.rank()}"
    try:
        if fmt >= 2:
            state = safe_state.load(os.path.join(step_dir, "trainer_state.json"))
            rng_file = os.path.join(step_dir, f"{rng_name}.json")
            rng = safe_state.load(rng_file) if os.path.isfile(rng_file) else None
        else:  # format 1 (before checkpoints were data only): the same content, pickled
            legacy = safe_state.find_legacy(step_dir, "trainer_state")
            if legacy is None:
                raise CheckpointError(f"{step_dir} holds no trainer state (trainer_state.pt, format 1, or "
                                      f"trainer_state.json with format {FORMAT} in its manifest): not a verl_ds checkpoint")
            state = safe_state.load_legacy_pickle(legacy)
            rng_file = safe_state.find_legacy(step_dir, rng_name)
            rng = safe_state.load_legacy_pickle(rng_file) if rng_file else None
    except safe_state.UnsafeStateError as exc:
        raise CheckpointError(f"refusing to resume from {step_dir}: {exc}. verl_ds reads its own checkpoint state as "
                              "data only, so this file was not written by verl_ds as it is (a checkpoint directory must "
                              "be writable by the job's owner alone: docs/reliability.md, 'Trust model'); resume from "
                              "another checkpoint (trainer.resume=<dir>) or start fresh (trainer.resume=none)") from None
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot resume from {step_dir}: its trainer or RNG state is unreadable "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or "global_step" not in state:
        raise CheckpointError(f"cannot resume from {step_dir}: its trainer state is not a verl_ds trainer state")
    return state, rng


def _restore_rng(step_dir: str, rng: Optional[dict], step: int, seed: int) -> None:
    if rng is not None:
        set_rng_state(rng)
        return
    vdist.seed_everything(derived_seed(seed, step, vdist.rank()))  # torch's: all devices, CUDA included
    log.warning("rank %d has no saved RNG in %s (saved by fewer ranks): seeded from (seed=%d, step=%d, rank)",
                vdist.rank(), step_dir, seed, step)


@contextlib.contextmanager
def _explain_disk_errors(ckpt_root: str, step_dir: str):
    """A write that failed for want of space (ENOSPC, EDQUOT, EFBIG, torch's zip writer's "unexpected pos") becomes a
    CheckpointError saying so, with the path and the free space."""
    try:
        yield
    except Exception as exc:
        why = _disk_trouble(exc)
        if why is None:
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"cannot save checkpoint {step_dir} (rank {vdist.rank()}): {why} ({type(exc).__name__}: {first}); "
            f"out of disk space? {_space_report(ckpt_root)}. Free disk space (or lower trainer.keep_last) and "
            f"restart: the previous complete checkpoint is untouched, and the incomplete "
            f"{os.path.basename(step_dir)} is never resumed") from exc


_DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for the file system or the process's file size limit"}


def _disk_trouble(exc: BaseException) -> Optional[str]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            return _DISK_ERRNOS[exc.errno]
        if isinstance(exc, RuntimeError) and any(k in str(exc) for k in ("unexpected pos", "file write failed",
                                                                         "failed writing")):
            return "a file could not be written to its end"
        exc = exc.__cause__ or exc.__context__
    return None


def _space_report(path: str) -> str:
    try:
        st = os.statvfs(path)
        report = (f"the file system of {path} has {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of "
                  f"{st.f_blocks * st.f_frsize / 2**20:.1f} MiB")
    except OSError as exc:
        report = f"the free space of {path} is unknown ({exc.strerror})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        report += f"; this process may not write files larger than {limit} bytes (ulimit -f)"
    return report


def _load_engine(step_dir: str, role: str, engine, saved_world: int, stage: int) -> None:
    from verl_ds.engines import universal

    role_dir = os.path.join(step_dir, role)
    if saved_world == vdist.world_size() or stage == 0:  # stage 0 states are whole: any world size
        # a LoRA engine's checkpoint lacks the frozen base by design (its trainable set was checked above)
        path, _ = engine.load_checkpoint(role_dir, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
                                         load_module_strict=not _has_frozen(engine))
    else:
        uni_dir = os.path.join(role_dir, CONVERTED)
        error = None
        if vdist.rank() == 0:
            try:
                universal.convert(os.path.join(role_dir, TAG), os.path.join(uni_dir, TAG))
            except Exception as exc:  # every rank must hear about it, not wait in the barrier below
                error = f"{type(exc).__name__}: {exc}"
        error = vdist.broadcast_object(error)
        if error is not None:
            raise CheckpointError(f"cannot convert {role_dir} (saved by {saved_world} ranks) for {vdist.world_size()} "
                                  f"ranks with DeepSpeed's ds_to_universal: {error}")
        path, _ = universal.load_universal(engine, uni_dir, TAG)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the {role} checkpoint in {role_dir}")


def load(step_dir: str, engines: dict, verify: Optional[str] = "edges", seed: int = 0) -> dict:
    """Restore the trained engines and this rank's RNG (``seed``: for ranks with none saved); returns the trainer state.
    ``verify``: "sizes", "edges" or "full" first (None: the caller did), CheckpointDamaged before anything is loaded."""
    if verify is not None:
        reason = verify_distributed(step_dir, verify)
        if reason is not None:
            raise CheckpointDamaged(f"cannot resume from {step_dir}: {reason}")
    manifest, reason = _read_manifest(step_dir)
    if reason is not None:
        raise CheckpointDamaged(f"cannot resume from {step_dir}: {reason}")
    try:  # before any engine changes: a bad state file loads nothing, and every rank stops on any rank's
        state, rng, error = *_read_states(step_dir, manifest), None
    except CheckpointError as exc:
        state, rng, error = None, None, str(exc)
    error = next((e for e in vdist.gather_object(error) if e is not None), None)
    if error is not None:
        raise CheckpointError(error)
    saved_world = int(manifest.get("world_size") or vdist.world_size())
    trained = _trained(engines)
    saved_roles = manifest.get("roles", ["actor", "critic"])
    missing = [role for role in trained if role not in saved_roles]
    if missing:
        raise CheckpointError(f"{step_dir} holds no {missing} (it has {saved_roles}); a run with a critic cannot resume "
                              "from a critic-free checkpoint")
    stages = manifest.get("zero_stage", {})
    for role, engine in trained.items():
        if role in stages and stages[role] != _zero_stage(engine):
            raise CheckpointError(f"{step_dir}: the {role} was saved at ZeRO stage {stages[role]}, this run uses stage "
                                  f"{_zero_stage(engine)}; resume with deepspeed.zero_stage={stages[role]}")
        saved_sig, sig = manifest.get("trainable", {}).get(role), trainable_signature(engine)
        if saved_sig is not None and saved_sig["digest"] != sig["digest"]:
            raise CheckpointError(f"{step_dir}: the {role} was saved training {_describe_trainable(saved_sig)}, this run "
                                  f"trains {_describe_trainable(sig)}; resume with the same {role}.lora_* keys")
        # DeepSpeed's engine files are read by its own loader (torch.load of pickles): the trust boundary
        _load_engine(step_dir, role, engine, saved_world, stages.get(role, _zero_stage(engine)))
    _restore_rng(step_dir, rng, step_of(step_dir), seed)
    return state
