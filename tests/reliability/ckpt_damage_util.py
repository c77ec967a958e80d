"""Damage real checkpoints the way a disk, a crash or someone with write access would, and rewrite the manifest
as such a person could (it is not signed). Used by test_checkpoint_damage.py and tests/checkpoint/."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import torch

MARKER_ENV = "VERL_DS_TEST_PWNED_MARKER"


class Payload:
    """A pickle that, when unpickled with a full unpickler, creates the file named by its argument."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_payload(path: str, marker: str) -> None:
    """A torch.save file whose unpickling runs ``touch marker`` (what a hostile trainer_state.pt would do)."""
    torch.save({"global_step": Payload(marker), "shared_state": Payload(marker)}, path)


def _edge(path: str) -> str:
    """sha256 of the size, the first and the last MiB (docs/reliability.md, "Crash safety")."""
    h, size = hashlib.sha256(), os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        if size > 1 << 20:
            fh.seek(max(1 << 20, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def rewrite_manifest(step_dir: str, drop: tuple = (), keep_format: bool = True) -> dict:
    """Recompute COMPLETE over the files now in ``step_dir`` (sizes, edge and full digests), leaving out ``drop``;
    ``keep_format=False`` removes the format marker (an older version's manifest). Returns the manifest."""
    path = os.path.join(step_dir, "COMPLETE")
    manifest = json.load(open(path))
    files = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != "COMPLETE" and rel not in drop:
                files[rel] = os.path.getsize(os.path.join(root, name))
    manifest["files"] = files
    manifest["digests"] = {rel: _edge(os.path.join(step_dir, rel)) for rel in files}
    if "sha256" in manifest:
        manifest["sha256"] = {rel: hashlib.sha256(open(os.path.join(step_dir, rel), "rb").read()).hexdigest()
                              for rel in files}
    if not keep_format:
        manifest.pop("format", None)
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=1)
    return manifest


def optim_shard(step_dir: str, role: str = "actor") -> str:
    return os.path.join(step_dir, role, "state", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def nan_in_the_middle(path: str, count: int = 16) -> int:
    """Overwrite ``count`` float32 values in the middle of ``path`` with NaN (4-byte aligned: torch aligns tensor
    data to 64 bytes in its zip files); returns the offset."""
    offset = (os.path.getsize(path) // 2) // 4 * 4
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<f", float("nan")) * count)
    return offset


def flip_middle_bit(path: str) -> None:
    offset = os.path.getsize(path) // 2
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))


def copy_run(src: str, dst: str) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("run.lock"))
    return dst


def to_format_1(step_dir: str) -> None:
    """Rewrite a checkpoint as verl_ds wrote it before format 2: trainer state and RNG pickled with torch.save,
    trainer_state.json a readable copy, no format in the manifest."""
    from verl_ds import safe_state

    state = safe_state.load(os.path.join(step_dir, "trainer_state.json"))
    torch.save(state, os.path.join(step_dir, "trainer_state.pt"))
    for name in os.listdir(step_dir):
        if name.startswith("rng_rank") and name.endswith(".json"):
            stem = name[:-len(".json")]
            torch.save(safe_state.load(os.path.join(step_dir, name)), os.path.join(step_dir, stem + ".pt"))
            os.remove(os.path.join(step_dir, name))
            os.remove(os.path.join(step_dir, stem + ".safetensors"))
    with open(os.path.join(step_dir, "trainer_state.json"), "w") as fh:
        json.dump(state, fh, indent=1, sort_keys=True, default=str)
    rewrite_manifest(step_dir, keep_format=False)
