"""The bounded queue between generation and training, and the staleness rule that admits samples to an update.
``put`` blocks while the queue is full (back-pressure: a slow trainer stops generation instead of growing memory);
``take`` admits only groups at most ``max_staleness`` versions old and drops or hands back the others, counted with
their lengths (dropping stale samples drops long ones first: ``async/length_stale`` vs ``async/length_kept``)."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from verl_ds.batch import RolloutBatch

STALE_POLICIES = ("drop", "regenerate")


class ProducerError(RuntimeError):
    """The generation side failed or went silent; the message says which rank and what happened."""


@dataclass
class Group:
    """The ``n`` samples of one prompt: the scored batch rows, their decoded responses, the prompt's data set index
    and each response token's actor version (``versions`` (n, R) int64, -1 past a response's end)."""
    batch: RolloutBatch
    responses: list
    index: int
    versions: torch.Tensor
    # the per-sample values of the reward metrics (``verl_ds.rollout.Rollout.per_sample``), (n,) each
    per_sample: dict = field(default_factory=dict)

    def oldest(self) -> int:
        """The oldest version among the group's response tokens."""
        valid = self.versions[self.versions >= 0]
        return int(valid.min()) if valid.numel() else int(self.versions.max())

    def mean_length(self) -> float:
        return float(self.batch.response_length.float().mean())

    def to_state(self) -> dict:
        b = self.batch
        return {"fields": {f: b[f].cpu() for f in b.present()}, "extras": {k: list(v) for k, v in b.extras.items()},
                "responses": list(self.responses), "index": int(self.index), "versions": self.versions.cpu(),
                "per_sample": {k: v.cpu() for k, v in self.per_sample.items()}}

    @classmethod
    def from_state(cls, state: dict, device=None) -> "Group":
        fields = {f: t.to(device) if device is not None else t for f, t in state["fields"].items()}
        return cls(batch=RolloutBatch(extras=dict(state["extras"]), **fields), responses=list(state["responses"]),
                   index=int(state["index"]), versions=state["versions"].to(torch.int64),
                   per_sample=dict(state.get("per_sample", {})))


class SampleQueue:
    """A FIFO of ``Group`` with a capacity in groups, for one producer and one consumer thread. ``close(error)`` wakes
    every waiter: ``put`` raises, ``take`` raises ProducerError with ``error`` once nothing admissible is left."""

    def __init__(self, capacity: int, name: str = "rank 0"):
        if capacity < 1:
            raise ValueError(f"SampleQueue: capacity must be >= 1 group, got {capacity}")
        self.capacity, self.name = int(capacity), name
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._closed, self._error = False, None
        self.blocked_s = 0.0  # how long the producer waited on a full queue (back-pressure)
        self.high_water = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def lock(self) -> threading.Condition:
        """The queue's lock: hold it to change the producer's bookkeeping atomically with ``put``."""
        return self._cond

    def put(self, group: Group, on_put: Optional[Callable[[Group], None]] = None) -> None:
        """Append ``group``, blocking while full; ``on_put(group)`` runs under the lock; ProducerError once closed."""
        with self._cond:
            t0 = time.perf_counter()
            while len(self._items) >= self.capacity and not self._closed:
                self._cond.wait()
            self.blocked_s += time.perf_counter() - t0
            if self._closed:
                raise ProducerError(f"{self.name}: the sample queue is closed")
            self._items.append(group)
            self.high_water = max(self.high_water, len(self._items))
            if on_put is not None:
                on_put(group)
            self._cond.notify_all()

    def take(self, k: int, version: int, max_staleness: int, policy: str, timeout: float,
             on_stale: Optional[Callable[[Group], None]] = None,
             on_kept: Optional[Callable[[Group], None]] = None,
             on_returned: Optional[Callable[[list], None]] = None) -> tuple[list, dict]:
        """``k`` admitted groups in arrival order and the call's metrics. A group over ``max_staleness`` is dropped or
        (``"regenerate"``) passed to ``on_stale``; callbacks run under the lock. After ``timeout`` s without a group:
        ProducerError, with the groups admitted so far back at the front (a checkpoint after the failure holds them)."""
        if policy not in STALE_POLICIES:
            raise ValueError(f"SampleQueue.take: policy must be one of {STALE_POLICIES}, got {policy!r}")
        kept, stale, staleness = [], [], []

        def fail(message: str):
            self.give_back(kept, on_returned)
            return ProducerError(message)

        with self._cond:
            while len(kept) < k:
                deadline = time.monotonic() + timeout
                while not self._items:
                    if self._closed:
                        raise fail(f"{self.name}: generation stopped before the step's samples were ready: "
                                   f"{self._error or 'the producer was closed'}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise fail(f"{self.name}: no sample from the rollout producer for {timeout:.0f} s "
                                   f"(half of trainer.dist_timeout_s); it hangs or is far too slow")
                    self._cond.wait(left)
                group = self._items.popleft()
                age = version - group.oldest()
                if age > max_staleness:
                    stale.append(group)
                    if policy == "regenerate" and on_stale is not None:
                        on_stale(group)
                else:
                    kept.append(group)
                    staleness.append(age)
                    if on_kept is not None:
                        on_kept(group)
                self._cond.notify_all()
            queued = len(self._items)
        return kept, self._metrics(kept, stale, staleness, policy, queued, max_staleness)

    @staticmethod
    def _metrics(kept: list, stale: list, staleness: list, policy: str, queued: int, max_staleness: int) -> dict:
        out = {"async/staleness/mean": torch.tensor(sum(staleness) / len(staleness), dtype=torch.float64),
               "async/staleness/max": torch.tensor(float(max(staleness)), dtype=torch.float64),
               "async/stale_groups": torch.tensor(float(len(stale))),
               "async/dropped": torch.tensor(float(len(stale) if policy == "drop" else 0)),
               "async/regenerated": torch.tensor(float(len(stale) if policy == "regenerate" else 0)),
               "async/queue_len": torch.tensor(float(queued)),
               "async/length_kept": torch.tensor(sum(g.mean_length() for g in kept) / len(kept)),
               # every rank logs the same keys (one all-reduce): 0 when no group went stale (see stale_groups)
               "async/length_stale": torch.tensor(sum(g.mean_length() for g in stale) / max(len(stale), 1))}
        for s in range(max_staleness + 1):  # the histogram of the admitted groups' staleness, 0..max_staleness
            out[f"async/staleness_hist/{s}"] = torch.tensor(float(sum(1 for a in staleness if a == s)))
        return out

    def give_back(self, groups: list, on_returned: Optional[Callable[[list], None]] = None) -> None:
        """Put taken ``groups`` back at the front in order (their step failed); may pass the capacity once."""
        with self._cond:
            self._items.extendleft(reversed(groups))
            if on_returned is not None and groups:
                on_returned(groups)
            self._cond.notify_all()

    def close(self, error: Optional[BaseException] = None) -> None:
        """Stop the queue: blocked ``put``/``take`` calls return (with ProducerError)."""
        with self._cond:
            self._closed = True
            if error is not None and self._error is None:
                self._error = f"{type(error).__name__}: {error}"
            self._cond.notify_all()

    def snapshot(self) -> list:
        """The queued groups' states, oldest first (call under ``lock`` for a consistent view with the producer)."""
        with self._cond:
            return [g.to_state() for g in self._items]

    def restore(self, states: list, device=None) -> None:
        """Put saved groups back (before the producer starts); more than the capacity is allowed once."""
        with self._cond:
            self._items.extend(Group.from_state(s, device) for s in states)
