"""Checkpoints that resume exactly and never become ``latest`` half-written.

Layout under ``<output_dir>/checkpoints``::

    global_step_<N>/actor/...          DeepSpeed save_checkpoint (client_state: the trainer state)
    global_step_<N>/critic/...         DeepSpeed save_checkpoint
    global_step_<N>/rng_rank<r>.pt     every rank's RNG states (python, numpy, torch, cuda)
    global_step_<N>/trainer_state.json the same trainer state, readable
    global_step_<N>/COMPLETE           manifest (file -> size, and a digest of its first and last MiB),
                                       written after every rank finished
    latest                             the name of the newest complete checkpoint, written last

A directory without a valid manifest (a job killed while saving), with a missing or truncated file, or
with a file whose first or last MiB changed (overwritten, a torn write; a torch/zip file keeps its
index at the end) is skipped, with a message naming it, for the previous complete one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch

from verl_ds import dist as vdist

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MANIFEST = "COMPLETE"
_EDGE = 1 << 20  # bytes hashed at each end of a file: cheap even for multi-GB shards


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


def verify(step_dir: str, digests: bool = True) -> Optional[str]:
    """None when ``step_dir`` is a complete checkpoint, else the reason it is not (``digests``: also re-hash
    the ends of every file)."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return "no COMPLETE manifest (the save did not finish)"
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable COMPLETE manifest ({exc})"
    expected = manifest.get("digests", {}) if digests else {}
    for rel, size in files.items():
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        if os.path.getsize(full) != size:
            return f"file {rel} has {os.path.getsize(full)} bytes, the manifest says {size}"
        if rel in expected and edge_digest(full) != expected[rel]:
            return f"file {rel} is corrupt (its content differs from the manifest's digest)"
    return None


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


def save(ckpt_root: str, step: int, engines: dict, trainer_state: dict, keep_last: int, on_event=None) -> str:
    """Save a complete checkpoint (all ranks call this); returns its directory.

    ``engines``: role -> DeepSpeed engine ("actor" first; "critic" when there is one). ``on_event(point)`` is
    called at named points ("after_actor", "after_critic", "before_manifest", "before_latest"): listeners
    such as the fault-injection tests see the save's progress.
    """
    name = f"global_step_{step}"
    step_dir = os.path.join(ckpt_root, name)
    hook = on_event or (lambda point: None)
    actor_engine, critic_engine = engines["actor"], engines.get("critic")
    if vdist.rank() == 0:
        if os.path.isdir(step_dir):  # an incomplete leftover from a killed run: never mix files of two saves
            shutil.rmtree(step_dir)
        os.makedirs(step_dir, exist_ok=True)
    vdist.barrier()
    actor_engine.save_checkpoint(os.path.join(step_dir, "actor"), tag="state", client_state={"verl_ds": trainer_state},
                                 save_latest=False)
    hook("after_actor")
    if critic_engine is not None:
        critic_engine.save_checkpoint(os.path.join(step_dir, "critic"), tag="state", save_latest=False)
        hook("after_critic")
    torch.save(rng_state(), os.path.join(step_dir, f"rng_rank{vdist.rank()}.pt"))
    vdist.barrier()
    if vdist.rank() == 0:
        fsync_write(os.path.join(step_dir, "trainer_state.json"),
                    json.dumps(trainer_state, indent=1, sort_keys=True, default=str).encode())
        _fsync_tree(step_dir)
        hook("before_manifest")
        files = _manifest(step_dir)
        manifest = {"step": step, "world_size": vdist.world_size(), "files": files,
                    "digests": {rel: edge_digest(os.path.join(step_dir, rel)) for rel in files}}
        fsync_write(os.path.join(step_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
        hook("before_latest")
        fsync_write(os.path.join(ckpt_root, "latest"), name.encode())
        _prune(ckpt_root, keep_last)
    vdist.barrier()
    return step_dir


def _prune(ckpt_root: str, keep_last: int) -> None:
    complete = sorted((n for n in os.listdir(ckpt_root) if _STEP_DIR.match(n)
                       and verify(os.path.join(ckpt_root, n), digests=False) is None),
                      key=lambda n: int(_STEP_DIR.match(n).group(1)))
    for name in complete[:-keep_last]:
        shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)


def load(step_dir: str, engines: dict, verify: str = "edges") -> dict:
    """Restore the engines (weights, optimizer; role -> engine as in ``save``) and this rank's RNG; returns the
    trainer state."""
    reason = _verify(step_dir)
    if reason is not None:
        raise CheckpointError(f"cannot resume from {step_dir}: {reason}")
    with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as fh:
        saved_world = json.load(fh).get("world_size")
    if saved_world is not None and saved_world != vdist.world_size():
        raise CheckpointError(f"{step_dir} was saved with {saved_world} ranks but this job has {vdist.world_size()}; "
                              "ZeRO checkpoints resume at the same world size")
    actor_engine, critic_engine = engines["actor"], engines.get("critic")
    path, client_state = actor_engine.load_checkpoint(os.path.join(step_dir, "actor"), tag="state",
                                                      load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the actor checkpoint in {step_dir}/actor")
    if critic_engine is not None:
        path, _ = critic_engine.load_checkpoint(os.path.join(step_dir, "critic"), tag="state",
                                                load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the critic checkpoint in {step_dir}/critic")
    rng_file = os.path.join(step_dir, f"rng_rank{vdist.rank()}.pt")
    set_rng_state(torch.load(rng_file, weights_only=False))
    if "verl_ds" not in (client_state or {}):
        raise CheckpointError(f"{step_dir}/actor holds no verl_ds trainer state (not a verl_ds checkpoint?)")
    return client_state["verl_ds"]


_verify = verify  # load() takes a `verify` mode argument
