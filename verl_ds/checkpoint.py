"""Checkpoints that resume exactly, at the same or another world size, and never become ``latest`` half-written.

Layout under ``<output_dir>/checkpoints``::

    global_step_<N>/<role>/state/...   DeepSpeed save_checkpoint of each trained engine (actor, critic if any)
    global_step_<N>/rng_rank<r>.pt     every rank's RNG states (python, numpy, torch, cuda)
    global_step_<N>/trainer_state.pt   the trainer state (pickled, exact); trainer_state.json: the same, readable
    global_step_<N>/COMPLETE           manifest: world size, roles and ZeRO stages, every file's size, a digest of
                                       its first and last MiB and (digest="full") the sha256 of all its bytes;
                                       written after every rank finished
    latest                             the name of the newest complete checkpoint, written last

A directory without a valid manifest (a job killed while saving), with a missing or truncated file, or
with a file whose first or last MiB changed (overwritten, a torn write; a torch/zip file keeps its
index at the end) is skipped, with a message naming it, for the previous complete one. ``verify(mode="full")``
re-hashes every byte (a bit flip in the middle of a large shard), each rank a share of the files.

Frozen engines (the reference, a reward model) are not saved: they are rebuilt from the model. Nor is the
frozen base of a LoRA engine: its checkpoint holds the adapters and their optimizer state, and the manifest
records what each engine trains (``trainable_signature``), so a resume with other LoRA keys is refused.

Another world size (elastic resume): a ZeRO-1/2/3 engine saved by N ranks is converted once by
DeepSpeed's ``ds_to_universal`` (``verl_ds.engines.universal``) and loaded by M ranks, weights and Adam
moments; stage 0 states are whole and load as they are. RNG policy: rank r restores the RNG saved by
rank r when there was one (r < N); a rank beyond the saved ones seeds python, numpy and torch from
sha256(seed, step, r), so its draws are reproducible but not a continuation. Data order: the trainer
state's sampler position counts global batches (``DistributedPromptSampler``), so with the same
``rollout.batch_size`` the run continues with the same sequence of global batches, each now split
into M rank slices instead of N.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from typing import Callable, Optional

import numpy as np
import torch

from verl_ds import dist as vdist

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MANIFEST = "COMPLETE"
TAG = "state"
_EDGE = 1 << 20  # bytes hashed at each end of a file: cheap even for multi-GB shards
_BLOCK = 8 << 20  # read size of a full hash
VERIFY_MODES = ("sizes", "edges", "full")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and what is wrong."""


def fsync_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _manifest(step_dir: str) -> dict:
    files = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name == MANIFEST or ".tmp." in name:
                continue
            full = os.path.join(root, name)
            files[os.path.relpath(full, step_dir)] = os.path.getsize(full)
    return files


def edge_digest(path: str) -> str:
    """sha256 of the size, the first and the last MiB of a file."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(_EDGE))
        if size > _EDGE:
            fh.seek(max(_EDGE, size - _EDGE))
            h.update(fh.read(_EDGE))
    return h.hexdigest()


def _fsync_tree(step_dir: str) -> None:
    for root, _, names in os.walk(step_dir):
        for name in names:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)


def full_digest(path: str) -> str:
    """sha256 of every byte of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(_BLOCK)
            if not block:
                return h.hexdigest()
            h.update(block)


def _read_manifest(step_dir: str):
    """(manifest dict, None) or (None, the reason it cannot be used)."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None, "no COMPLETE manifest (the save did not finish)"
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
        if not isinstance(manifest["files"], dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable COMPLETE manifest ({exc})"
    return manifest, None


def _check_files(step_dir: str, manifest: dict, mode: str, names) -> Optional[str]:
    """The first problem among ``names`` (manifest paths) under ``mode``, or None."""
    edges = manifest.get("digests", {})
    full = manifest.get("sha256", {})
    for rel in names:
        size = manifest["files"][rel]
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"missing file {rel}"
        if os.path.getsize(path) != size:
            return f"file {rel} has {os.path.getsize(path)} bytes, the manifest says {size}"
        if mode == "edges" and rel in edges and edge_digest(path) != edges[rel]:
            return f"file {rel} is corrupt (its content differs from the manifest's digest)"
        if mode == "full":
            if rel not in full:
                return (f"the manifest has no full digest of {rel} (saved with digest='edges'); verify it with "
                        "mode='edges'")
            if full_digest(path) != full[rel]:
                return f"file {rel} is corrupt (the sha256 of its bytes differs from the manifest's)"
    return None


def _check_mode(mode: str) -> str:
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode: expected one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    return mode


def verify(step_dir: str, mode: str = "edges", digests: bool = True) -> Optional[str]:
    """None when ``step_dir`` is a complete checkpoint, else the reason it is not.

    ``mode``: "sizes" (every file present with its size), "edges" (also the digests of each file's first and
    last MiB: fast), "full" (also the sha256 of every byte: reads the whole checkpoint, ~0.4 GB/s per core
    here; ``benchmarks/checkpoint_verify.py``). ``digests=False`` is the older spelling of mode="sizes".
    """
    mode = _check_mode("sizes" if not digests else mode)
    manifest, reason = _read_manifest(step_dir)
    if reason is not None:
        return reason
    return _check_files(step_dir, manifest, mode, sorted(manifest["files"]))


def verify_distributed(step_dir: str, mode: str = "edges") -> Optional[str]:
    """``verify`` with the files shared out over the ranks (a collective; same answer on every rank)."""
    mode = _check_mode(mode)
    manifest, reason = _read_manifest(step_dir)
    if reason is None:
        mine = _share(manifest["files"], vdist.rank(), vdist.world_size())
        reason = _check_files(step_dir, manifest, mode, mine)
    reasons = vdist.gather_object(reason)
    return next((r for r in reasons if r is not None), None)


def _share(sizes: dict, rank: int, world: int) -> list:
    """This rank's files: largest first, each to the rank with the fewest bytes so far (balanced reading)."""
    load = [0] * world
    mine = []
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        owner = min(range(world), key=lambda k: (load[k], k))
        load[owner] += sizes[rel]
        if owner == rank:
            mine.append(rel)
    return mine


def step_of(step_dir: str) -> int:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(step_dir)))
    if not m:
        raise CheckpointError(f"{step_dir!r} is not a checkpoint directory (expected a name like global_step_12)")
    return int(m.group(1))


def find_resumable(ckpt_root: str) -> Optional[str]:
    """The newest complete checkpoint under ``ckpt_root``: the ``latest`` one when valid, else scan backwards.

    Every directory passed over is named in a warning with the reason, including newer ones than ``latest``
    (a save killed before it finished, or before it updated ``latest``).
    """
    if not os.path.isdir(ckpt_root):
        return None
    candidates = []
    latest_file = os.path.join(ckpt_root, "latest")
    if os.path.isfile(latest_file):
        with open(latest_file, encoding="utf-8") as fh:
            name = fh.read().strip()
        if name:
            candidates.append(name)
    names = sorted((n for n in os.listdir(ckpt_root) if _STEP_DIR.match(n)), key=lambda n: -int(_STEP_DIR.match(n).group(1)))
    candidates += [n for n in names if n not in candidates]
    for i, name in enumerate(candidates):
        step_dir = os.path.join(ckpt_root, name)
        if not os.path.isdir(step_dir):
            log.warning("checkpoint %s named by 'latest' does not exist; looking for an older one", step_dir)
            continue
        reason = verify(step_dir)
        if reason is not None:
            log.warning("skipping checkpoint %s: %s; trying the previous one", step_dir, reason)
            continue
        if i == 0 and _STEP_DIR.match(name):  # 'latest' is valid: say what newer directories are left behind
            for newer in (n for n in names if int(_STEP_DIR.match(n).group(1)) > step_of(step_dir)):
                why = verify(os.path.join(ckpt_root, newer))
                log.warning("skipping checkpoint %s: %s; resuming from %s (named by 'latest')",
                            os.path.join(ckpt_root, newer),
                            why or "complete, but 'latest' was not updated to it (a save killed at its very end, "
                                   "or a run abandoned by resuming from an older checkpoint)", step_dir)
        return step_dir
    return None


def _trained(engines: dict) -> dict:
    """The engines a checkpoint holds: those with an optimizer (frozen ones are rebuilt from the model)."""
    if not isinstance(engines, dict) or not engines:
        raise TypeError(f"engines: expected a non-empty mapping role -> DeepSpeed engine, got {engines!r}")
    # a frozen ZeRO-3 engine still has an ``optimizer`` (DeepSpeed's parameter offload helper), never a basic one
    return {role: e for role, e in engines.items() if getattr(e, "basic_optimizer", None) is not None}


def _has_frozen(engine) -> bool:
    return any(not p.requires_grad for p in engine.module.parameters())


def trainable_signature(engine) -> dict:
    """What an engine trains: count, total size and a digest of the names and shapes of its trainable parameters
    (LoRA adapters or every weight), and whether it has a frozen base."""
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
    """Save a complete checkpoint (all ranks call this); returns its directory.

    ``engines``: role -> DeepSpeed engine (critic-free runs have no critic); those with an optimizer are saved.
    ``on_event(point)`` is called at named points ("after_<role>" for each saved engine, "before_manifest",
    "before_latest"): listeners such as the fault-injection tests see the save's progress.
    ``digest``: "full" records the sha256 of every file (each rank hashes a share) so that
    ``verify(mode="full")`` can detect any changed byte; "edges" records only the digests of the file ends.
    """
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

    for role, engine in trained.items():  # a frozen base (LoRA) is rebuilt from the model, never saved
        engine.save_checkpoint(os.path.join(step_dir, role), tag=TAG, save_latest=False, client_state=client_state(),
                               exclude_frozen_parameters=_has_frozen(engine))
        hook(f"after_{role}")
    torch.save(rng_state(), os.path.join(step_dir, f"rng_rank{vdist.rank()}.pt"))
    if vdist.rank() == 0:
        torch.save(trainer_state, os.path.join(step_dir, "trainer_state.pt"))
        fsync_write(os.path.join(step_dir, "trainer_state.json"),
                    json.dumps(trainer_state, indent=1, sort_keys=True, default=str).encode())
    vdist.barrier()
    files = _manifest(step_dir) if vdist.rank() == 0 else None
    files = vdist.broadcast_object(files)
    full = {}
    if digest == "full":  # each rank hashes its share of the bytes; rank 0 collects
        for part in vdist.gather_object({rel: full_digest(os.path.join(step_dir, rel))
                                         for rel in _share(files, vdist.rank(), vdist.world_size())}):
            full.update(part)
    if vdist.rank() == 0:
        _fsync_tree(step_dir)
        hook("before_manifest")
        manifest = {"step": step, "world_size": vdist.world_size(), "roles": list(trained),
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
    """The RNG seed of a rank that has no saved RNG (resuming at a larger world size)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little") % 2**63


def _restore_rng(step_dir: str, step: int, seed: int) -> None:
    rng_file = os.path.join(step_dir, f"rng_rank{vdist.rank()}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
        return
    s = derived_seed(seed, step, vdist.rank())
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)  # all devices, CUDA included
    log.warning("rank %d has no saved RNG in %s (saved by fewer ranks): seeded from (seed=%d, step=%d, rank)",
                vdist.rank(), step_dir, seed, step)


def _load_engine(step_dir: str, role: str, engine, saved_world: int, stage: int) -> None:
    from verl_ds.engines import universal

    role_dir = os.path.join(step_dir, role)
    if saved_world == vdist.world_size() or stage == 0:  # stage 0 states are whole: any world size
        # a LoRA engine's checkpoint lacks the frozen base by design (its trainable set was checked above)
        path, _ = engine.load_checkpoint(role_dir, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
                                         load_module_strict=not _has_frozen(engine))
    else:
        uni_dir = os.path.join(role_dir, "universal")
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


def load(step_dir: str, engines: dict, verify: str = "edges", seed: int = 0) -> dict:
    """Restore the trained engines (weights, optimizer; role -> engine as in ``save``) and this rank's RNG, at
    the saved world size or another one (see the module docstring); returns the trainer state.

    ``verify``: the check run first ("sizes", "edges" or "full"; the files are shared out over the ranks).
    ``seed``: the run's seed, for ranks that have no saved RNG.
    """
    reason = verify_distributed(step_dir, verify)
    if reason is not None:
        raise CheckpointError(f"cannot resume from {step_dir}: {reason}")
    manifest, _ = _read_manifest(step_dir)
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
        _load_engine(step_dir, role, engine, saved_world, stages.get(role, _zero_stage(engine)))
    state_file = os.path.join(step_dir, "trainer_state.pt")
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{step_dir} holds no trainer_state.pt (not a verl_ds checkpoint of this version?)")
    state = torch.load(state_file, weights_only=False)
    _restore_rng(step_dir, step_of(step_dir), seed)
    return state
