"""Asynchronous rollouts on each rank (``rollout.mode`` one_step_off or streaming: docs/async.md): the one streaming
producer (``stream``) with a single lane, this rank's, on the HF replica; the trainer's thread takes from it and
refreshes the weights. Versions count the trainer's steps (the weights after step k's update are version k + 1)."""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from verl_ds import dist as vdist
from verl_ds.asyncrl.queue import SampleQueue
from verl_ds.asyncrl.reshard import rank_part
from verl_ds.asyncrl.source import RolloutRun, RolloutSource
from verl_ds.asyncrl.stream import Lane, StreamProducer, WeightGate, assemble, versioned_rollout
from verl_ds.metrics import Timings
from verl_ds.rollout import Rollout, collect

log = logging.getLogger(__name__)


class AsyncRollout(RolloutSource):
    """The trainer's rollouts in one_step_off / streaming mode: ``next_rollout`` takes from the queue the generation
    thread fills, ``refresh`` the weight refresh; ``state_dict`` carries the queue, prompts in flight and the sampler."""

    def __init__(self, run: RolloutRun):
        cfg = run.cfg
        self.run, self.cfg, self.mode = run, cfg, cfg.rollout.mode
        self.engine = run.registry.get("actor").rollout_engine
        self.per_step = run.sampler.batch_size  # prompts (groups) per rank and step
        first = 1 if self.mode == "one_step_off" else max(1, int(run.state.get("max_staleness")))
        self.lane = Lane(SampleQueue(self.per_step * (1 + first), name=f"rank {run.rank}"), run.sampler, 0)
        # half the collective timeout: a silent generation thread is reported (naming this rank) while the other
        # ranks still wait in the step's next collective, within trainer.dist_timeout_s
        self.wait_s = 0.5 * float(cfg.trainer.dist_timeout_s)
        self.gate = WeightGate(0, mid_response=self.mode == "streaming", timeout=self.wait_s, name=f"rank {run.rank}")
        self.producer = StreamProducer({run.rank: self.lane}, self.per_step, self.gate, self.staleness_bound,
                                       self._make, name=f"rank {run.rank}")
        self._taken: list = []  # the groups the step in progress took (``rewind``)

    @property
    def queue(self) -> SampleQueue:
        return self.lane.queue

    def staleness_bound(self) -> int:
        return 1 if self.mode == "one_step_off" else int(self.run.state.get("max_staleness"))

    def next_rollout(self, step: int, timings: Timings) -> Rollout:
        """This rank's rollout for ``step``: ``per_step`` groups from the queue, none older than the bound."""
        if self.producer.thread is None:
            self._start(step)

        def boundary():  # a skipped step changed no weights but counts; wakes a waiting generation thread
            self.producer.requested = step
            self.gate.version = max(self.gate.version, step)
        self.gate.poke(boundary)
        self._taken = []  # a take that fails hands back its own groups
        with timings("gen_wait"):
            groups, metrics = self.lane.take(self.per_step, self.gate.version, self.staleness_bound(),
                                             self.cfg.rollout.stale_samples, self.wait_s)
        self._taken = groups
        self.gate.poke(lambda: None)  # as before: the generation thread at a decoding step or between batches
        # generate time since the last step; the reward values of the samples taken (maybe several generate calls')
        metrics = {**metrics, "async/gen_busy_s": torch.tensor(self.producer.busy_since_last())}
        return assemble(groups, metrics, self.run.tokenizer.pad_token_id, self.cfg.rollout.n)

    def refresh(self) -> None:
        """After the update: the replica takes the new weights (a ZeRO-3 collective), the generation thread waiting."""
        self.gate.update(refresh=self.engine.refresh)

    def rewind(self) -> None:
        """A failed step's groups go back to the queue's front, so the fault's checkpoint holds them."""
        taken, self._taken = self._taken, []
        self.lane.give_back(taken)

    def close(self, code: int = 0) -> None:
        """Stop the generation thread (its batch in flight is abandoned; ``code``: as ``RemoteRollout.close``)."""
        self.producer.close()

    def _start(self, step: int) -> None:
        if self.engine.replica is None:  # the first refresh is a collective: here, on the trainer's thread
            self.engine.refresh()
        self.gate.version = self.producer.requested = step
        self.lane.consumed = step * self.per_step
        self.engine.step_hook = self.gate.hook
        self.engine.generate = self._exclusive(self.engine.generate)
        self.producer.start(f"verl-ds-rollout-rank{self.run.rank}")

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

    def _make(self, key, indices: list) -> Rollout:
        """One generation call on the generation thread (gate held): sampled with the run's current settings."""
        run, algo = self.run, self.cfg.algo
        prompts = run.prompts(indices)
        return collect(lambda: prompts, run.registry.get("actor"), run.registry.get("reward"), run.tokenizer,
                       sampling=run.sampling(), n=self.cfg.rollout.n, timings=Timings(),
                       overlong=(algo.overlong_buffer, algo.overlong_penalty_factor),
                       greedy_baseline=run.needs_baseline(), rollout_fn=versioned_rollout(self.engine))

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every rank's queue, prompts in flight and to redo, sampler position (a collective: rank 0 saves them all)."""
        return {"mode": self.mode, "world_size": vdist.world_size(), "ranks": vdist.gather_object(self.lane.snapshot())}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore this rank's part before the generation thread starts: queued groups first, then the prompts in
        flight, generated again with the restored weights; at another world size dealt by ``reshard``."""
        if state is None:  # a synchronous run's checkpoint: the sampler's position, restored by the trainer
            return
        if "ranks" not in state:  # a split run's checkpoint from before its queues were saved: nothing to restore
            log.warning("resume: the checkpoint holds no rollout queues (%s); generating from the data position",
                        state.get("mode"))
            return
        mine, notes = rank_part(state, vdist.world_size(), vdist.rank(), drop_last=self.run.sampler.drop_last)
        for k, line in enumerate(notes if vdist.rank() == 0 else ()):
            (log.info if k == 0 else log.warning)("resume: %s", line)
        self.lane.restore(mine, self.run.device)


__all__ = ["AsyncRollout"]
