"""Asynchronous rollouts on each rank: a generation thread on the HF replica feeding a bounded ``SampleQueue``
(``rollout.mode`` one_step_off or streaming: docs/async.md). Versions count the trainer's steps (the weights after
step k's update are version k + 1). The generation thread never enters a collective: the weight refresh, a ZeRO-3
gather, runs on the trainer's thread while the generation thread waits at a decoding step."""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch

from verl_ds import dist as vdist
from verl_ds.asyncrl.queue import Group, ProducerError, SampleQueue
from verl_ds.asyncrl.reshard import rank_part
from verl_ds.asyncrl.source import RolloutRun, RolloutSource
from verl_ds.metrics import Timings
from verl_ds.rollout import Rollout, _pad_to, collect, rollout_and_score

log = logging.getLogger(__name__)


def taken_samples(groups: list) -> dict:
    """The per-sample reward values of the groups a step trains on (``Rollout.per_sample``), not the generate calls'."""
    keys = dict.fromkeys(k for g in groups for k in g.per_sample)
    return {k: torch.cat([g.per_sample[k] for g in groups if k in g.per_sample]) for k in keys}


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


class AsyncRollout(RolloutSource):
    """The trainer's rollouts in one_step_off / streaming mode: ``next_rollout`` takes from the queue the generation
    thread fills, ``refresh`` the weight refresh; ``state_dict`` carries the queue, prompts in flight and the sampler."""

    def __init__(self, run: RolloutRun):
        cfg = run.cfg
        self.run, self.cfg, self.mode = run, cfg, cfg.rollout.mode
        self.engine = run.registry.get("actor").rollout_engine
        self.per_step = run.sampler.batch_size  # prompts (groups) per rank and step
        first = 1 if self.mode == "one_step_off" else max(1, int(run.state.get("max_staleness")))
        self.queue = SampleQueue(self.per_step * (1 + first), name=f"rank {run.rank}")
        # half the collective timeout: a silent generation thread is reported (naming this rank) while the other
        # ranks still wait in the step's next collective, within trainer.dist_timeout_s
        self.wait_s = 0.5 * float(cfg.trainer.dist_timeout_s)
        self.gate = WeightGate(0, mid_response=self.mode == "streaming", timeout=self.wait_s,
                               name=f"rank {run.rank}")
        self._inflight: list = []  # [data set index, version at its start] of prompts drawn, not yet queued
        # what comes before the sampler's next batch, in order: data set indices to generate (again: stale under
        # "regenerate", or in flight at a save) and saved Groups to queue as they are (a resume at another world size)
        self._todo: list = []
        self._consumed = self._requested = 0  # groups trained on so far; the step the trainer waits for
        self._taken: list = []  # the groups the step in progress took (``rewind``)
        self._thread: Optional[threading.Thread] = None
        self._stop, self.busy_s, self._busy_mark, self.error = False, 0.0, 0.0, None

    # ------------------------------------------------------------------ the trainer's side

    def staleness_bound(self) -> int:
        return 1 if self.mode == "one_step_off" else int(self.run.state.get("max_staleness"))

    def next_rollout(self, step: int, timings: Timings) -> Rollout:
        """This rank's rollout for ``step``: ``per_step`` groups from the queue, none older than the bound."""
        if self._thread is None:
            self._start(step)
        self._requested = step
        self.gate.update(version=step)  # a skipped step changed no weights but counts; wakes a waiting producer
        self._taken = []  # a take that fails hands back its own groups
        with timings("gen_wait"):
            groups, metrics = self.queue.take(self.per_step, self.gate.version, self.staleness_bound(),
                                              self.cfg.rollout.stale_samples, self.wait_s,
                                              on_stale=lambda g: self._todo.append(g.index), on_kept=self._took,
                                              on_returned=self._untook)
        self._taken = groups
        self.gate.poke(lambda: None)  # as before: the generation thread at a decoding step or between batches
        pad = self.run.tokenizer.pad_token_id
        width = max(g.batch.prompt_width for g in groups)
        rwidth = max(g.batch.response_width for g in groups)
        from verl_ds.batch import RolloutBatch

        batch = RolloutBatch.cat([_pad_to(g.batch, width, rwidth, pad) for g in groups])
        n = self.cfg.rollout.n
        batch.group_index = torch.arange(len(groups), device=batch.action.device).repeat_interleave(n)
        busy, self._busy_mark = self.busy_s - self._busy_mark, self.busy_s  # generate time since the last step
        # the reward values of the samples taken, which may come from several generation calls
        return Rollout(batch=batch, responses=[r for g in groups for r in g.responses],
                       metrics={**metrics, "async/gen_busy_s": torch.tensor(busy)}, per_sample=taken_samples(groups))

    def refresh(self) -> None:
        """After the update: the replica takes the new weights (a ZeRO-3 collective), the generation thread waiting."""
        self.gate.update(refresh=self.engine.refresh)

    def close(self, code: int = 0) -> None:
        """Stop the generation thread (its batch in flight is abandoned; ``code``: as ``RemoteRollout.close``)."""
        self._stop = True
        self.queue.close()
        if self.gate.cond.acquire(timeout=1.0):  # a hung generation thread holds it: nothing to wake then
            self.gate.cond.notify_all()
            self.gate.cond.release()
        if self._thread is not None:
            self._thread.join(timeout=10)  # a daemon thread: a batch still generating is left to end with us

    # ------------------------------------------------------------------ the generation thread

    def _start(self, step: int) -> None:
        if self.engine.replica is None:  # the first refresh is a collective: here, on the trainer's thread
            self.engine.refresh()
        self.gate.version = self._requested = step
        self._consumed = step * self.per_step
        self.engine.step_hook = self.gate.hook
        self.engine.generate = self._exclusive(self.engine.generate)
        self._thread = threading.Thread(target=self._run, name=f"verl-ds-rollout-rank{self.run.rank}",
                                        daemon=True)
        self._thread.start()

    def _exclusive(self, generate):
        """``generate`` for the trainer's own calls (validation) run while the generation thread waits at a decoding
        step: a plain HF generate swaps the model's generation config in and out for its call."""
        def call(*args, **kwargs):
            if threading.get_ident() == self.gate.producer:
                return generate(*args, **kwargs)
            out = []
            self.gate.poke(lambda: out.append(generate(*args, **kwargs)))
            return out[0]
        return call

    def _took(self, group: Group) -> None:
        self._consumed += 1  # under the queue's lock, as the group leaves the queue: ``_due`` never misses it

    def _untook(self, groups: list) -> None:
        self._consumed -= len(groups)

    def rewind(self) -> None:
        """A failed step's groups go back to the queue's front, so the fault's checkpoint holds them."""
        taken, self._taken = self._taken, []
        self.queue.give_back(taken, self._untook)

    def _due(self) -> int:
        """The step a batch started now would be trained at (no group dropped in between)."""
        with self.queue.lock:  # a group the trainer takes leaves the queue and joins _consumed at once
            ahead = self._consumed + len(self.queue) + len(self._inflight)
        return ahead // self.per_step

    def _may_start(self) -> bool:
        s, due = self.staleness_bound(), self._due()
        return due - s <= self.gate.version and (s > 0 or self._requested >= due)

    def _run(self) -> None:
        self.gate.producer = threading.get_ident()
        try:
            while not self._stop:
                if self._todo and isinstance(self._todo[0], Group):  # a saved group: queued as it is, in its turn
                    self.queue.put(self._todo[0], on_put=lambda g: self._todo.pop(0))
                    continue
                with self.gate.cond:
                    self.gate.cond.wait_for(lambda: self._stop or self._may_start())
                    if self._stop:
                        break
                    t0 = time.perf_counter()
                    ro, indices = self._generate()
                    self.busy_s += time.perf_counter() - t0
                for group in self._groups(ro, indices):
                    self.queue.put(group, on_put=self._landed)
        except BaseException as exc:  # noqa: BLE001 - the trainer's next take reports it, naming this rank
            if not self._stop:
                self.error = exc
                log.error("rank %d: the rollout thread failed: %s: %s", self.run.rank, type(exc).__name__, exc)
            self.queue.close(exc)

    def _landed(self, group: Group) -> None:
        for k, (index, _) in enumerate(self._inflight):
            if index == group.index:
                del self._inflight[k]
                return

    def _generate(self):
        """One generation call (gate held): the head of ``_todo`` (up to a saved group), else the sampler's batch."""
        run = self.run
        with self.queue.lock:  # drawn and registered in flight together (a checkpoint sees both or neither)
            if self._todo:
                k = next((j for j, x in enumerate(self._todo[:self.per_step]) if isinstance(x, Group)),
                         min(self.per_step, len(self._todo)))
                indices, self._todo = self._todo[:k], self._todo[k:]
            else:
                indices = list(run.sampler.next_batch())
            self._inflight.extend([i, self.gate.version] for i in indices)
        prompts, algo = run.prompts(indices), self.cfg.algo
        ro = collect(lambda: prompts, run.registry.get("actor"), run.registry.get("reward"), run.tokenizer,
                     sampling=run.sampling(), n=self.cfg.rollout.n, timings=Timings(),
                     overlong=(algo.overlong_buffer, algo.overlong_penalty_factor),
                     greedy_baseline=run.needs_baseline(), rollout_fn=self._sample)
        return ro, indices

    def _sample(self, actor, reward, tokenizer, prompts, **kw) -> Rollout:
        """``rollout_and_score`` that keeps each response column's version (per row, through ``collect``)."""
        ro = rollout_and_score(actor, reward, tokenizer, prompts, **kw)
        if not kw.get("greedy"):
            versions = tuple(self.engine.last_versions.get(threading.get_ident(), ()))
            ro.batch.extras["actor_versions"] = [versions] * len(ro.batch)
        return ro

    @staticmethod
    def _groups(ro: Rollout, indices: list) -> list:
        """A sampled and scored batch as one Group per prompt (also the split generation ranks': ``split_stream``)."""
        b = ro.batch
        per_row = b.extras.pop("actor_versions")
        R = b.response_width
        # the rows of one generate call share one version list: one (R,) row per distinct list, not per row
        rows_of = {t: torch.tensor(list(t) + [-1] * (R - len(t)), dtype=torch.int64) for t in set(per_row)}
        v = torch.stack([rows_of[t] for t in per_row]) if len(rows_of) > 1 else \
            rows_of[per_row[0]].expand(len(per_row), R)
        v = torch.where(torch.arange(R)[None, :] < b.response_length.cpu()[:, None], v, -1)
        out = []
        for g, index in enumerate(indices):
            rows = (b.group_index == g).nonzero().flatten()
            out.append(Group(batch=b.select(rows), responses=[ro.responses[int(r)] for r in rows.tolist()],
                             index=int(index), versions=v[rows.cpu()],
                             per_sample={k: x[rows] for k, x in ro.per_sample.items()}))
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every rank's queue, prompts in flight and to redo, sampler position (a collective: rank 0 saves them all)."""
        with self.queue.lock:
            mine = {"queue": self.queue.snapshot(), "inflight": [list(x) for x in self._inflight],
                    "redo": [x.to_state() if isinstance(x, Group) else int(x) for x in self._todo],
                    "sampler": self.run.sampler.state_dict()}
        return {"mode": self.mode, "world_size": vdist.world_size(), "ranks": vdist.gather_object(mine)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore this rank's part before the generation thread starts: queued groups first, then the prompts in
        flight, generated again with the restored weights; at another world size dealt by ``reshard``."""
        if state is None:  # a synchronous run's checkpoint: the sampler's position, restored by the trainer
            return
        device = self.run.device
        if "ranks" not in state:  # a split run's checkpoint from before its queues were saved: nothing to restore
            log.warning("resume: the checkpoint holds no rollout queues (%s); generating from the data position",
                        state.get("mode"))
            return
        mine, notes = rank_part(state, vdist.world_size(), vdist.rank(), drop_last=self.run.sampler.drop_last)
        for k, line in enumerate(notes if vdist.rank() == 0 else ()):
            (log.info if k == 0 else log.warning)("resume: %s", line)
        self.queue.restore(mine["queue"], device=device)
        self._todo = [Group.from_state(x, device) if isinstance(x, dict) else int(x) for x in mine["redo"]]
        self.run.sampler.load_state_dict(mine["sampler"])


__all__ = ["AsyncRollout", "WeightGate", "ProducerError"]
