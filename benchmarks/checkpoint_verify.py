"""What ``checkpoint.verify`` costs on a large file: "sizes" vs "edges" (first and last MiB) vs "full" (every byte).

Writes a checkpoint-shaped directory holding one ``--gib`` GiB shard plus its COMPLETE manifest (with full
sha256 digests, as ``checkpoint.save(digest="full")`` writes them), then times each verify mode, and the
full digest that the save itself computes. The file was just written, so it is read from the page cache:
the figures are hashing speed, a lower bound on a cold read from disk. Ratios are against "edges", timed
in the same run.

    python benchmarks/checkpoint_verify.py            # 1 GiB
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from verl_ds import checkpoint as ckpt


def _best_of(n: int, fn) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    size = int(args.gib * 2**30)
    with tempfile.TemporaryDirectory(prefix="verl_ds_verify_") as root:
        step_dir = os.path.join(root, "global_step_1")
        shard_dir = os.path.join(step_dir, "actor", "state")
        os.makedirs(shard_dir)
        block = os.urandom(64 << 20)
        with open(os.path.join(shard_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "wb") as fh:
            for start in range(0, size, len(block)):
                fh.write(block[:min(len(block), size - start)])
        files = ckpt._manifest(step_dir)
        t_save_full = _best_of(1, lambda: {rel: ckpt.full_digest(os.path.join(step_dir, rel)) for rel in files})
        manifest = {"step": 1, "world_size": 1, "files": files,
                    "digests": {rel: ckpt.edge_digest(os.path.join(step_dir, rel)) for rel in files},
                    "sha256": {rel: ckpt.full_digest(os.path.join(step_dir, rel)) for rel in files}}
        with open(os.path.join(step_dir, ckpt.MANIFEST), "w") as fh:
            json.dump(manifest, fh)
        times = {}
        for mode in ("sizes", "edges", "full"):
            assert ckpt.verify(step_dir, mode) is None
            times[mode] = _best_of(args.repeats, lambda: ckpt.verify(step_dir, mode))
        gib = size / 2**30
        for mode, t in times.items():
            print(f"verify mode={mode:<5} {t * 1e3:9.1f} ms  ({gib / t:7.2f} GiB/s)  "
                  f"x{t / times['edges']:.1f} vs edges")
        print(f"save(digest='full') extra: {t_save_full:.2f} s for {gib:.2f} GiB "
              "(shared over the ranks in a real save)")
        print(f"checkpoint_verify gib={gib:.2f} edges_s={times['edges']:.4f} full_s={times['full']:.3f} "
              f"full_over_edges={times['full'] / times['edges']:.0f}")


if __name__ == "__main__":
    main()
