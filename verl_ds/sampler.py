"""Each rank's share of every global batch, deterministic and resumable at any world size."""
from __future__ import annotations

import numpy as np


class DistributedPromptSampler:
    """This rank's prompt indices, one batch at a time, forever: global batch b of an epoch is
    permutation(seed, epoch)[b*G:(b+1)*G], G = batch_size_per_rank * world_size, rank r taking its slice."""

    def __init__(self, dataset_len: int, batch_size_per_rank: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, drop_last: bool = True):
        for name, value, low in (("dataset_len", dataset_len, 1), ("batch_size_per_rank", batch_size_per_rank, 1),
                                 ("world_size", world_size, 1), ("rank", rank, 0), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        self.dataset_len, self.batch_size, self.seed, self.drop_last = dataset_len, batch_size_per_rank, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.global_batch_size = batch_size_per_rank * world_size
        if dataset_len < self.global_batch_size:
            raise ValueError(f"the data set has {dataset_len} prompts, fewer than one global batch "
                             f"({batch_size_per_rank} per rank x {world_size} ranks = {self.global_batch_size}); "
                             "add prompts or lower the batch size")
        full, rest = divmod(dataset_len, self.global_batch_size)
        self.batches_per_epoch = full if drop_last or rest == 0 else full + 1
        self.epoch, self.position = 0, 0  # position: global batches already taken in this epoch
        self._perm_epoch, self._perm = None, None

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset_len)
            if not self.drop_last:  # wrap around so the last global batch is full
                self._perm = np.concatenate([self._perm, self._perm[:self.global_batch_size]])
            self._perm_epoch = self.epoch
        return self._perm

    def next_batch(self) -> list[int]:
        """This rank's indices for the next global batch."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.global_batch_size + self.rank * self.batch_size
        self.position += 1
        return self._permutation()[start:start + self.batch_size].tolist()

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_len": self.dataset_len, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (of the same data set size and global batch size)."""
        missing = [k for k in ("epoch", "position", "seed") if k not in state]
        if missing:
            raise ValueError(f"sampler state: missing keys {missing}; got {sorted(state)}")
        for key in ("dataset_len", "global_batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state: saved {key}={state[key]} but this run has {getattr(self, key)}; "
                                 "the data position cannot be resumed exactly (start without resuming the data, "
                                 "or restore the original data set / batch sizes)")
        epoch, position, seed = state["epoch"], state["position"], state["seed"]
        if not all(isinstance(v, int) and v >= 0 for v in (epoch, position, seed)) or position > self.batches_per_epoch:
            raise ValueError(f"sampler state: expected ints epoch >= 0, seed >= 0, 0 <= position <= "
                             f"{self.batches_per_epoch}; got epoch={epoch!r} position={position!r} seed={seed!r}")
        self.epoch, self.position, self.seed = epoch, position, seed
        self._perm_epoch = None
