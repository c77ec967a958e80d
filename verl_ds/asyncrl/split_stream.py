"""Streaming on split ranks: a generation rank runs up to ``max_staleness`` batches ahead of the training ranks it
serves, with partial rollouts and one queue per served rank (docs/async.md). Its main thread only answers the
bridge, in the order every rank follows; a generation thread fills the queues, each served rank's batches drawn
from that rank's own torch RNG stream (so ``max_staleness: 0`` is the synchronous run). A generation thread that
raises closes the queues: the next request's ``take`` raises on the main thread, which ends the process."""
from __future__ import annotations

import logging
import threading
import time

import torch

from verl_ds.asyncrl.placement import Placement, receive_weights
from verl_ds.asyncrl.producer import AsyncRollout, WeightGate, taken_samples
from verl_ds.asyncrl.queue import Group, SampleQueue
from verl_ds.asyncrl import split_state
from verl_ds.asyncrl.bridge import _REQUEST, _SAVE, _STOP, _WEIGHTS, _control, send_rollout
from verl_ds.metrics import Timings
from verl_ds.rollout import Rollout, _pad_to, collect, rollout_and_score

log = logging.getLogger(__name__)


class _Streamer:
    def __init__(self, placement: Placement, g, msg: dict):
        from verl_ds.generation import HFRolloutEngine
        from verl_ds.models import PolicyModel

        cfg, r = g.cfg, g.cfg.rollout
        self.pl, self.g, self.cfg = placement, g, cfg
        self.per_step = g.derived.prompts_per_rank
        self.wait_s = 0.5 * float(cfg.trainer.dist_timeout_s)  # as the colocated producer: within the bridge's timeout
        capacity = self.per_step * (1 + max(1, int(g.state.get("max_staleness"))))
        self.queues = {t: SampleQueue(capacity, name=f"generation rank {placement.rank} (for training rank {t})")
                       for t in g.served}
        step = int(msg["step"])
        self.gate = WeightGate(step, mid_response=True, timeout=self.wait_s, name=f"generation rank {placement.rank}")
        self.engine = HFRolloutEngine(g.model, pad_token_id=g.tok.pad_token_id, eos_token_id=g.tok.eos_token_id,
                                      bos_token_id=g.tok.bos_token_id, gather_params=False,
                                      share_prefill=r.share != "none", share_decode=r.share == "decode")
        self.engine.step_hook = self.gate.hook
        self.actor = PolicyModel(g.model, state=g.state, rollout_engine=self.engine, tokenizer=g.tok)
        self.inflight = {t: [] for t in g.served}  # [index, version at its start] drawn, not yet queued
        self.redo = {t: [] for t in g.served}  # indices handed back by take (rollout.stale_samples=regenerate)
        self.rng = {}  # each served rank's torch RNG stream (split_state.rng_now), swapped in to generate its batch
        self.consumed = {t: step * self.per_step for t in g.served}
        self.requested, self.stop, self.busy_s, self.busy_mark = step, False, 0.0, 0.0
        self.thread = threading.Thread(target=self._run, name=f"verl-ds-split-rollout-rank{placement.rank}",
                                       daemon=True)

    # ------------------------------------------------------------------ the main thread: the bridge
    def serve(self) -> int:
        from verl_ds import dist as vdist

        for t in self.g.served:  # each trainer's own stream (verl_ds.trainer), unless a resume restored it
            if t not in self.rng:
                torch.manual_seed(self.cfg.trainer.seed * 1000 + t)
                self.rng[t] = split_state.rng_now(self.pl.device)
        vdist.seed_everything(self.cfg.trainer.seed * 1000 + self.g.served[0])  # python's, numpy's
        self.thread.start()
        try:
            while True:
                cmd, code, msg = _control(self.pl.bridge)
                if cmd == _STOP:
                    return code
                if cmd == _WEIGHTS:  # lands at the generation thread's next decoding step
                    self.gate.update(refresh=lambda: (self.g.follow(msg), receive_weights(self.g.model, self.pl)))
                elif cmd == _REQUEST:
                    self._answer(msg)
                elif cmd == _SAVE:
                    split_state.save(self)
        finally:
            self._close()

    def _answer(self, msg: dict) -> None:
        """Step k's batches: the trainers' state, then each served rank's admitted groups."""
        step = int(msg["step"])

        def boundary():  # one pause of the generation thread (each costs the trainers up to a decoding step)
            self.g.follow(msg)
            self.requested = step
            self.gate.version = max(self.gate.version, step)  # a skipped step changed no weights but counts
        self.gate.poke(boundary)
        bound, policy = int(self.g.state.get("max_staleness")), self.cfg.rollout.stale_samples
        busy, self.busy_mark = self.busy_s - self.busy_mark, self.busy_s  # this rank's, reported to each served
        for t in self.g.served:
            # a kept group joins ``consumed`` as it leaves the queue, under the queue's lock: counted apart, the
            # generation thread could see it in neither, take its batch as still due and start it early
            groups, metrics = self.queues[t].take(self.per_step, self.gate.version, bound, policy, self.wait_s,
                                                  on_stale=lambda grp, t=t: self.redo[t].append(grp.index),
                                                  on_kept=lambda grp, t=t: self._took(t))
            metrics = {**metrics, "async/gen_busy_s": torch.tensor(busy),
                       "async/state_version": torch.tensor(float(self.g.state.version))}
            send_rollout(self.pl, self._batch(groups, metrics), t)
        self.gate.poke(lambda: None)  # wakes the generation thread: prompts handed back for regeneration may start

    def _batch(self, groups: list, metrics: dict) -> Rollout:
        from verl_ds.batch import RolloutBatch

        pad = self.g.tok.pad_token_id
        width = max(grp.batch.prompt_width for grp in groups)
        rwidth = max(grp.batch.response_width for grp in groups)
        batch = RolloutBatch.cat([_pad_to(grp.batch, width, rwidth, pad) for grp in groups])
        batch.group_index = torch.arange(len(groups), device=batch.action.device).repeat_interleave(self.cfg.rollout.n)
        return Rollout(batch=batch, responses=[x for grp in groups for x in grp.responses], metrics=metrics,
                       per_sample=taken_samples(groups))

    def _close(self) -> None:
        self.stop = True
        for q in self.queues.values():
            q.close()
        if self.gate.cond.acquire(timeout=1.0):  # a hung generation thread holds it: nothing to wake then
            self.gate.cond.notify_all()
            self.gate.cond.release()
        self.thread.join(timeout=10)

    # ------------------------------------------------------------------ the generation thread
    def _took(self, t: int) -> None:
        self.consumed[t] += 1

    def _due(self, t: int) -> int:
        """The step a batch for training rank ``t`` started now would be trained at."""
        with self.queues[t].lock:
            return (self.consumed[t] + len(self.queues[t]) + len(self.inflight[t])) // self.per_step

    def _next(self):
        """The served rank whose next batch may start now (the earliest due), or None."""
        s = int(self.g.state.get("max_staleness"))
        ready = [(self._due(t), t) for t in self.g.served if not (self.redo[t] and isinstance(self.redo[t][0], Group))]
        ready = [(due, t) for due, t in ready if due - s <= self.gate.version and (s > 0 or self.requested >= due)]
        return min(ready)[1] if ready else None

    def _run(self) -> None:
        self.gate.producer = threading.get_ident()
        try:
            while not self.stop:
                with self.gate.cond:
                    # a take that hands stale groups back (under the queue's lock) cannot notify this condition: look
                    # again now and then, or that take waits for a batch this thread never starts
                    if not self.gate.cond.wait_for(lambda: self.stop or self._saved() is not None
                                                   or self._next() is not None, timeout=0.5):
                        continue
                    if self.stop:
                        break
                    t = self._saved()
                    if t is not None:  # a group restored by a resume at another world size: queued in its turn
                        self.queues[t].put(self.redo[t][0], on_put=lambda grp, t=t: self.redo[t].pop(0))
                        continue
                    t = self._next()
                    t0 = time.perf_counter()
                    ro, indices = self._generate(t)
                    self.busy_s += time.perf_counter() - t0
                for group in AsyncRollout._groups(ro, indices):
                    self.queues[t].put(group, on_put=lambda grp, t=t: self._landed(t, grp))
        except BaseException as exc:  # noqa: BLE001 - the next request's take raises it on the main thread
            if not self.stop:
                log.error("generation rank %d: the rollout thread failed: %s: %s", self.pl.rank,
                          type(exc).__name__, exc)
            for q in self.queues.values():
                q.close(exc)

    def _saved(self):
        """A served rank whose next item to redo is a saved group with room in its queue, or None."""
        for t in self.g.served:
            q = self.queues[t]
            with q.lock:
                if self.redo[t] and isinstance(self.redo[t][0], Group) and len(q) < q.capacity:
                    return t
        return None

    def _landed(self, t: int, group) -> None:
        for k, (index, _) in enumerate(self.inflight[t]):
            if index == group.index:
                del self.inflight[t][k]
                return

    def _generate(self, t: int):
        g, algo = self.g, self.cfg.algo
        with self.queues[t].lock:
            if self.redo[t]:  # up to per_step prompts, up to a saved group
                k = next((j for j, x in enumerate(self.redo[t][:self.per_step]) if isinstance(x, Group)),
                         min(self.per_step, len(self.redo[t])))
                indices, self.redo[t] = self.redo[t][:k], self.redo[t][k:]
            else:
                indices = list(g.samplers[t].next_batch())
            self.inflight[t].extend([i, self.gate.version] for i in indices)
        prompts = g.prompts(indices)
        hot = g.state.snapshot()
        sampling = {k: hot[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
        split_state.rng_set(self.rng[t], self.pl.device)  # only this thread draws: training rank t's stream
        ro = collect(lambda: prompts, self.actor, g.reward, g.tok, sampling=sampling, n=self.cfg.rollout.n,
                     timings=Timings(), overlong=(algo.overlong_buffer, algo.overlong_penalty_factor),
                     rollout_fn=self._sample)
        self.rng[t] = split_state.rng_now(self.pl.device)
        return ro, indices

    def _sample(self, actor, reward, tokenizer, prompts, **kw) -> Rollout:
        """``rollout_and_score`` that keeps each response's per-token versions (``AsyncRollout._groups`` reads them)."""
        ro = rollout_and_score(actor, reward, tokenizer, prompts, **kw)
        versions = tuple(self.engine.last_versions.get(threading.get_ident(), ()))
        ro.batch.extras["actor_versions"] = [versions] * len(ro.batch)
        return ro


def serve_streaming(placement: Placement, g, msg: dict) -> int:
    """A generation rank in ``rollout.mode=streaming`` after the first control message (``msg``: the trainers' state
    and data position, its weights following): returns the exit code the training ranks sent."""
    g.follow(msg)
    receive_weights(g.model, placement)
    streamer = _Streamer(placement, g, msg)
    for t, part in split_state.receive_parts(placement, g.served).items():  # a resume: the checkpointed queues
        if part is not None:
            split_state.restore(streamer, t, part)
    return streamer.serve()
