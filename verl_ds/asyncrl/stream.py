"""The one streaming producer (docs/async.md): a generation thread fills one bounded queue per lane (a training rank it
serves) from that lane's sampler, as far ahead of the trainer as the staleness bound allows. Whoever serves the
trainer takes from the lanes: the trainer's own thread colocated (``producer``), a split generation rank's bridge loop
(``split_stream``). Weight refreshes run on that thread while the generation thread waits at a decoding step
(``WeightGate``), so the generation thread never enters a collective."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from verl_ds.asyncrl.queue import Group, ProducerError, SampleQueue
from verl_ds.rollout import Rollout, _pad_to, rollout_and_score

log = logging.getLogger(__name__)


class WeightGate:
    """Who may touch the replica's weights: the generation thread holds ``cond`` while it generates; ``update`` raises
    ``want`` and takes ``cond`` at that thread's next decoding step (``mid_response``) or at the end of its batch."""

    def __init__(self, version: int, mid_response: bool, timeout: Optional[float] = None, name: str = "rank 0"):
        self.cond = threading.Condition()
        self.version, self.mid_response, self.want = int(version), bool(mid_response), False
        self.producer: Optional[int] = None  # the generation thread's ident
        self.timeout, self.name = timeout, name  # how long the trainer waits for the generation thread to let go

    def hook(self) -> int:
        """The engine's per-step hook: the version of the weights that computed this step's logits; on the generation
        thread, lets a waiting weight update in before the next forward (streaming)."""
        v = self.version
        if self.want and self.mid_response and threading.get_ident() == self.producer:
            self.cond.wait_for(lambda: not self.want)
        return v

    def poke(self, fn) -> None:
        """On the trainer's thread: ``fn()`` holding ``cond`` (the generation thread paused), then wake that thread."""
        self.want = True
        if not self.cond.acquire(timeout=-1 if self.timeout is None else self.timeout):
            self.want = False
            raise ProducerError(f"{self.name}: the generation thread did not reach a decoding step or finish its batch "
                                f"within {self.timeout:.0f} s (half of trainer.dist_timeout_s); it hangs (a reward "
                                f"function?) or is far too slow")
        try:
            fn()
        finally:
            self.want = False
            self.cond.notify_all()
            self.cond.release()

    def update(self, refresh=None, version: Optional[int] = None) -> None:
        """``poke``: run ``refresh()`` (the replica's weight copy) and set the version (default +1)."""
        def run():
            if refresh is not None:
                refresh()
            self.version = self.version + 1 if version is None else max(self.version, int(version))
        self.poke(run)


def taken_samples(groups: list) -> dict:
    """The per-sample reward values of the groups a step trains on (``Rollout.per_sample``), not the generate calls'."""
    keys = dict.fromkeys(k for g in groups for k in g.per_sample)
    return {k: torch.cat([g.per_sample[k] for g in groups if k in g.per_sample]) for k in keys}


def assemble(groups: list, metrics: dict, pad_token_id: int, n: int) -> Rollout:
    """The step's rollout from the groups it takes, padded to the widest prompt and response."""
    from verl_ds.batch import RolloutBatch

    width = max(g.batch.prompt_width for g in groups)
    rwidth = max(g.batch.response_width for g in groups)
    batch = RolloutBatch.cat([_pad_to(g.batch, width, rwidth, pad_token_id) for g in groups])
    batch.group_index = torch.arange(len(groups), device=batch.action.device).repeat_interleave(n)
    return Rollout(batch=batch, responses=[r for g in groups for r in g.responses], metrics=metrics,
                   per_sample=taken_samples(groups))


def versioned_rollout(engine) -> Callable:
    """``rollout_and_score`` that keeps the versions of the weights that sampled each response column."""
    def sample(actor, reward, tokenizer, prompts, **kw) -> Rollout:
        ro = rollout_and_score(actor, reward, tokenizer, prompts, **kw)
        if not kw.get("greedy"):
            versions = tuple(engine.last_versions.get(threading.get_ident(), ()))
            ro.batch.extras["actor_versions"] = [versions] * len(ro.batch)
        return ro
    return sample


def groups_of(ro: Rollout, indices: list) -> list:
    """A sampled and scored batch as one Group per prompt, each response token with its version (-1 past its end)."""
    b = ro.batch
    per_row = b.extras.pop("actor_versions")
    R = b.response_width
    # the rows of one generate call share one version list: one (R,) row per distinct list, not per row
    rows_of = {t: torch.tensor(list(t) + [-1] * (R - len(t)), dtype=torch.int64) for t in set(per_row)}
    v = torch.stack([rows_of[t] for t in per_row]) if len(rows_of) > 1 else rows_of[per_row[0]].expand(len(per_row), R)
    v = torch.where(torch.arange(R)[None, :] < b.response_length.cpu()[:, None], v, -1)
    out = []
    for g, index in enumerate(indices):
        rows = (b.group_index == g).nonzero().flatten()
        out.append(Group(batch=b.select(rows), responses=[ro.responses[int(r)] for r in rows.tolist()],
                         index=int(index), versions=v[rows.cpu()],
                         per_sample={k: x[rows] for k, x in ro.per_sample.items()}))
    return out


class Lane:
    """One served training rank's stream: its queue and sampler, the prompts in flight ([index, version at its start]),
    what comes before the sampler's next batch (``todo``: data set indices to generate again, saved Groups to queue as
    they are) and the groups taken so far; with ``tracks_rng`` its own torch RNG stream (split placement)."""

    def __init__(self, queue: SampleQueue, sampler, consumed: int, tracks_rng: bool = False):
        self.queue, self.sampler, self.consumed, self.tracks_rng = queue, sampler, int(consumed), tracks_rng
        self.inflight: list = []
        self.todo: list = []
        self.rng: Optional[dict] = None

    def due(self, per_step: int) -> int:
        """The step a batch started now would be trained at (no group dropped in between)."""
        with self.queue.lock:  # a group taken leaves the queue and joins ``consumed`` at once
            return (self.consumed + len(self.queue) + len(self.inflight)) // per_step

    def saved_next(self) -> bool:
        return bool(self.todo) and isinstance(self.todo[0], Group)

    def take(self, n: int, version: int, bound: int, policy: str, wait_s: float):
        """``SampleQueue.take``; a stale group's prompt joins ``todo`` (regenerate), a kept one ``consumed``."""
        return self.queue.take(n, version, bound, policy, wait_s, on_stale=lambda g: self.todo.append(g.index),
                               on_kept=self._took, on_returned=self._untook)

    def give_back(self, groups: list) -> None:
        self.queue.give_back(groups, self._untook)

    def _took(self, group: Group) -> None:
        self.consumed += 1  # under the queue's lock, as the group leaves the queue: ``due`` never misses it

    def _untook(self, groups: list) -> None:
        self.consumed -= len(groups)

    def draw(self, per_step: int, version: int) -> list:
        """The next batch's data set indices: the head of ``todo`` (up to a saved group), else the sampler's batch."""
        with self.queue.lock:  # drawn and registered in flight together (a checkpoint sees both or neither)
            if self.todo:
                k = next((j for j, x in enumerate(self.todo[:per_step]) if isinstance(x, Group)),
                         min(per_step, len(self.todo)))
                indices, self.todo = self.todo[:k], self.todo[k:]
            else:
                indices = list(self.sampler.next_batch())
            self.inflight.extend([i, version] for i in indices)
        return indices

    def landed(self, group: Group) -> None:
        for k, (index, _) in enumerate(self.inflight):
            if index == group.index:
                del self.inflight[k]
                return

    def snapshot(self) -> dict:
        """Queued, in flight, to redo, the sampler (and the RNG stream): call with the generation thread paused."""
        with self.queue.lock:  # queued and in flight together: a group landing now is in one or the other
            out = {"queue": self.queue.snapshot(), "inflight": [list(x) for x in self.inflight],
                   "redo": [x.to_state() if isinstance(x, Group) else int(x) for x in self.todo],
                   "sampler": self.sampler.state_dict()}
        if self.tracks_rng:
            out["rng"] = dict(self.rng)
        return out

    def restore(self, part: dict, device) -> None:
        """Load a saved part (``reshard.rank_part``) before the generation thread starts: queued groups, then prompts
        and saved groups in their turn, then the sampler."""
        self.queue.restore(part["queue"], device=device)
        self.todo = [Group.from_state(x, device) if isinstance(x, dict) else int(x) for x in part["redo"]]
        self.sampler.load_state_dict(part["sampler"])
        if self.tracks_rng and part.get("rng") is not None:
            self.rng = part["rng"]


class StreamProducer:
    """The generation thread over ``lanes`` (key -> Lane). It starts the earliest-due lane's next batch once that
    batch, trained at its due step, stays within ``bound()`` versions of the weights (with bound 0: only once that step
    is ``requested``, the synchronous run); ``make(key, indices)`` generates and scores it holding the gate."""

    def __init__(self, lanes: dict, per_step: int, gate: WeightGate, bound: Callable[[], int],
                 make: Callable[[object, list], Rollout], name: str):
        self.lanes, self.per_step, self.gate, self.bound, self.make, self.name = lanes, per_step, gate, bound, make, name
        self.requested = 0  # the step the trainer waits for: set under the gate's condition
        self.stop, self.busy_s, self._mark, self.error = False, 0.0, 0.0, None
        self.thread: Optional[threading.Thread] = None

    def start(self, thread_name: str) -> None:
        self.thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self.thread.start()

    def busy_since_last(self) -> float:
        """Seconds spent generating since the last call (``async/gen_busy_s``)."""
        busy, self._mark = self.busy_s - self._mark, self.busy_s
        return busy

    def _pick(self):
        """(key, True) for a lane whose next item is a saved group with room in its queue; (key, False) for the
        earliest-due lane whose next batch may start; None."""
        for key, lane in self.lanes.items():
            with lane.queue.lock:
                if lane.saved_next() and len(lane.queue) < lane.queue.capacity:
                    return key, True
        s = self.bound()
        ready = [(lane.due(self.per_step), key) for key, lane in self.lanes.items() if not lane.saved_next()]
        ready = [(due, key) for due, key in ready if due - s <= self.gate.version and (s > 0 or self.requested >= due)]
        return (min(ready)[1], False) if ready else None

    def _run(self) -> None:
        self.gate.producer = threading.get_ident()
        try:
            while not self.stop:
                with self.gate.cond:
                    # a take that hands stale groups back (under the queue's lock) cannot notify this condition: look
                    # again now and then, or that take waits for a batch this thread never starts
                    if not self.gate.cond.wait_for(lambda: self.stop or self._pick() is not None, timeout=0.5):
                        continue
                    if self.stop:
                        break
                    key, saved = self._pick()
                    lane = self.lanes[key]
                    if saved:  # a group restored by a resume (at another world size): queued as it is, in its turn
                        lane.queue.put(lane.todo[0], on_put=lambda g: lane.todo.pop(0))
                        continue
                    t0 = time.perf_counter()
                    indices = lane.draw(self.per_step, self.gate.version)
                    ro = self.make(key, indices)
                    self.busy_s += time.perf_counter() - t0
                for group in groups_of(ro, indices):
                    lane.queue.put(group, on_put=lane.landed)
        except BaseException as exc:  # noqa: BLE001 - the next take raises it on the serving thread, naming the rank
            if not self.stop:
                self.error = exc
                log.error("%s: the rollout thread failed: %s: %s", self.name, type(exc).__name__, exc)
            for lane in self.lanes.values():
                lane.queue.close(exc)

    def close(self) -> None:
        """Stop the generation thread (a batch in flight is abandoned)."""
        self.stop = True
        for lane in self.lanes.values():
            lane.queue.close()
        if self.gate.cond.acquire(timeout=1.0):  # a hung generation thread holds it: nothing to wake then
            self.gate.cond.notify_all()
            self.gate.cond.release()
        if self.thread is not None:
            self.thread.join(timeout=10)  # a daemon thread: a batch still generating is left to end with us
