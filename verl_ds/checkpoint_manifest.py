"""A checkpoint's COMPLETE manifest (each file's size and digests), the checks against it, and the choice of the
checkpoint to resume from. Unsigned: it detects accidents, not someone who may write the directory (docs/reliability.md,
"Trust model")."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Optional

from verl_ds import dist as vdist

log = logging.getLogger("verl_ds.checkpoint")

STEP_DIR = re.compile(r"^global_step_(\d+)$")
MANIFEST = "COMPLETE"
EDGE = 1 << 20  # bytes hashed at each end of a file: cheap even for multi-GB shards
BLOCK = 8 << 20  # read size of a full hash
VERIFY_MODES = ("sizes", "edges", "full")
CONVERTED = "universal"  # <role>/universal/: DeepSpeed's universal checkpoint, converted after the save (elastic)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and what is wrong."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not match its manifest (nothing was loaded from it)."""


def fsync_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_listed(rel: str, roles) -> bool:
    """Whether the manifest covers ``rel``: everything but itself, temp files and the universal conversion."""
    parts = rel.split(os.sep)
    return not (rel == MANIFEST or ".tmp." in parts[-1] or (len(parts) > 2 and parts[0] in roles
                                                             and parts[1] == CONVERTED))


def list_files(step_dir: str, roles=()) -> dict:
    """relative path -> size of every file the manifest must cover."""
    files = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, step_dir)
            if _is_listed(rel, roles):
                files[rel] = os.path.getsize(full)
    return files


def edge_digest(path: str) -> str:
    """sha256 of the size, the first and the last MiB of a file."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(EDGE))
        if size > EDGE:
            fh.seek(max(EDGE, size - EDGE))
            h.update(fh.read(EDGE))
    return h.hexdigest()


def full_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(BLOCK)
            if not block:
                return h.hexdigest()
            h.update(block)


def read_manifest(step_dir: str):
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


def _unlisted(step_dir: str, manifest: dict) -> Optional[str]:
    extra = sorted(set(list_files(step_dir, manifest.get("roles", ("actor", "critic")))) - set(manifest["files"]))
    if extra:
        return (f"file {extra[0]} is not in the manifest (added after the save, or its entry removed; "
                f"{len(extra)} such file(s))")
    return None


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


def check_mode(mode: str) -> str:
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode: expected one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    return mode


def verify(step_dir: str, mode: str = "edges", digests: bool = True) -> Optional[str]:
    """None when ``step_dir`` is a complete checkpoint, else why not. ``mode``: "sizes" (every file present with its
    size, none unlisted), "edges" (also each file's first and last MiB), "full" (also every byte: reads it all)."""
    mode = check_mode("sizes" if not digests else mode)
    manifest, reason = read_manifest(step_dir)
    if reason is not None:
        return reason
    return _unlisted(step_dir, manifest) or _check_files(step_dir, manifest, mode, sorted(manifest["files"]))


def verify_distributed(step_dir: str, mode: str = "edges") -> Optional[str]:
    """``verify`` with the files shared out over the ranks (a collective; same answer on every rank)."""
    mode = check_mode(mode)
    manifest, reason = read_manifest(step_dir)
    if reason is None:
        reason = _unlisted(step_dir, manifest) if vdist.rank() == 0 else None
        mine = share(manifest["files"], vdist.rank(), vdist.world_size())
        reason = reason or _check_files(step_dir, manifest, mode, mine)
    reasons = vdist.gather_object(reason)
    return next((r for r in reasons if r is not None), None)


def share(sizes: dict, rank: int, world: int) -> list:
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
    m = STEP_DIR.match(os.path.basename(os.path.normpath(step_dir)))
    if not m:
        raise CheckpointError(f"{step_dir!r} is not a checkpoint directory (expected a name like global_step_12)")
    return int(m.group(1))


def _read_latest(ckpt_root: str) -> Optional[str]:
    """The directory name ``latest`` holds when it is one of this run's step directories, else None (warned)."""
    path = os.path.join(ckpt_root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as fh:
        name = fh.read().strip()
    if not name:
        return None
    if not STEP_DIR.match(name):  # an absolute path or ../other_run/...: another run's checkpoint, never resumed
        log.warning("ignoring 'latest' in %s: it names %r, not a global_step_<N> directory of this run; looking "
                    "for this run's newest complete checkpoint instead", ckpt_root, name[:200])
        return None
    return name


def _outside(ckpt_root: str, step_dir: str) -> Optional[str]:
    """Why ``step_dir`` is not this run's own directory (a link elsewhere), or None."""
    real = os.path.realpath(step_dir)
    if os.path.dirname(real) != os.path.realpath(ckpt_root):
        return f"a link to {real}, outside this run's checkpoints (only this run's own directories are resumed)"
    return None


def scan(ckpt_root: str, mode: str = "edges") -> tuple[list, list]:
    """(checkpoints that verify, best first: ``latest``'s, then older ones newest first; [(directory, reason)] passed
    over, each warned about, newer ones than ``latest`` included)."""
    if not os.path.isdir(ckpt_root):
        return [], []
    latest = _read_latest(ckpt_root)
    names = sorted((n for n in os.listdir(ckpt_root) if STEP_DIR.match(n)), key=lambda n: -int(STEP_DIR.match(n).group(1)))
    if latest is not None and latest not in names:
        log.warning("checkpoint %s named by 'latest' does not exist; looking for an older one",
                    os.path.join(ckpt_root, latest))
        latest = None
    good, skipped, latest_ok = [], [], False
    for name in ([latest] if latest else []) + [n for n in names if n != latest]:
        step_dir = os.path.join(ckpt_root, name)
        newer_than_latest = latest_ok and step_of(name) > step_of(latest)
        reason = _outside(ckpt_root, step_dir) or verify(step_dir, mode)
        if newer_than_latest:
            reason = reason or ("complete, but 'latest' was not updated to it (a save killed at its very end, or a run "
                                "abandoned by resuming from an older checkpoint)")
            log.warning("skipping checkpoint %s: %s; resuming from %s (named by 'latest')", step_dir, reason, good[0])
        elif reason is not None:
            log.warning("skipping checkpoint %s: %s; trying the previous one", step_dir, reason)
        if reason is not None:
            skipped.append((step_dir, reason))
        else:
            good.append(step_dir)
        latest_ok = latest_ok or (name == latest and reason is None)
    return good, skipped


def find_resumable(ckpt_root: str) -> Optional[str]:
    """The newest complete checkpoint under ``ckpt_root``: the ``latest`` one when valid, else scan backwards."""
    good, _ = scan(ckpt_root)
    return good[0] if good else None
