"""Streaming on split ranks: a generation rank runs the one streaming producer (``stream``) with a lane per training
rank it serves, up to ``max_staleness`` batches ahead, with partial rollouts (docs/async.md). Its main thread only
answers the bridge, in the order every rank follows; each lane's batches are drawn from that training rank's own
torch RNG stream (so ``max_staleness: 0`` is the synchronous run). A generation thread that raises closes the queues:
the next request's ``take`` raises on the main thread, which ends the process."""
from __future__ import annotations

import torch

from verl_ds.asyncrl import split_state
from verl_ds.asyncrl.bridge import _REQUEST, _SAVE, _STOP, _WEIGHTS, _control, send_rollout
from verl_ds.asyncrl.placement import Placement, receive_weights
from verl_ds.asyncrl.queue import SampleQueue
from verl_ds.asyncrl.stream import Lane, StreamProducer, WeightGate, assemble, versioned_rollout
from verl_ds.metrics import Timings
from verl_ds.rollout import Rollout, collect


class _Streamer:
    def __init__(self, placement: Placement, g, msg: dict):
        from verl_ds.generation import HFRolloutEngine
        from verl_ds.models import PolicyModel

        cfg, r = g.cfg, g.cfg.rollout
        self.pl, self.g, self.cfg = placement, g, cfg
        self.per_step = g.derived.prompts_per_rank
        self.wait_s = 0.5 * float(cfg.trainer.dist_timeout_s)  # as the colocated producer: within the bridge's timeout
        capacity = self.per_step * (1 + max(1, int(g.state.get("max_staleness"))))
        step = int(msg["step"])
        self.lanes = {t: Lane(SampleQueue(capacity, name=f"generation rank {placement.rank} (for training rank {t})"),
                              g.samplers[t], step * self.per_step, tracks_rng=True) for t in g.served}
        self.gate = WeightGate(step, mid_response=True, timeout=self.wait_s, name=f"generation rank {placement.rank}")
        self.engine = HFRolloutEngine(g.model, pad_token_id=g.tok.pad_token_id, eos_token_id=g.tok.eos_token_id,
                                      bos_token_id=g.tok.bos_token_id, gather_params=False,
                                      share_prefill=r.share != "none", share_decode=r.share == "decode")
        self.engine.step_hook = self.gate.hook
        self.actor = PolicyModel(g.model, state=g.state, rollout_engine=self.engine, tokenizer=g.tok)
        self.producer = StreamProducer(self.lanes, self.per_step, self.gate, lambda: int(g.state.get("max_staleness")),
                                       self._make, name=f"generation rank {placement.rank}")
        self.producer.requested = step

    # ------------------------------------------------------------------ the main thread: the bridge
    def serve(self) -> int:
        from verl_ds import dist as vdist

        for t, lane in self.lanes.items():  # each trainer's own stream (verl_ds.trainer), unless a resume restored it
            if lane.rng is None:
                torch.manual_seed(self.cfg.trainer.seed * 1000 + t)
                lane.rng = split_state.rng_now(self.pl.device)
        vdist.seed_everything(self.cfg.trainer.seed * 1000 + self.g.served[0])  # python's, numpy's
        self.producer.start(f"verl-ds-split-rollout-rank{self.pl.rank}")
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
            self.producer.close()

    def _answer(self, msg: dict) -> None:
        """Step k's batches: the trainers' state, then each served rank's admitted groups."""
        step = int(msg["step"])

        def boundary():  # one pause of the generation thread (each costs the trainers up to a decoding step)
            self.g.follow(msg)
            self.producer.requested = step
            self.gate.version = max(self.gate.version, step)  # a skipped step changed no weights but counts
        self.gate.poke(boundary)
        bound, policy = int(self.g.state.get("max_staleness")), self.cfg.rollout.stale_samples
        busy = self.producer.busy_since_last()  # this rank's, reported to each served rank
        for t, lane in self.lanes.items():
            groups, metrics = lane.take(self.per_step, self.gate.version, bound, policy, self.wait_s)
            metrics = {**metrics, "async/gen_busy_s": torch.tensor(busy),
                       "async/state_version": torch.tensor(float(self.g.state.version))}
            send_rollout(self.pl, assemble(groups, metrics, self.g.tok.pad_token_id, self.cfg.rollout.n), t)
        self.gate.poke(lambda: None)  # wakes the generation thread: prompts handed back for regeneration may start

    def _make(self, t: int, indices: list) -> Rollout:
        """Training rank ``t``'s next batch on the generation thread (gate held), drawn from ``t``'s RNG stream."""
        g, algo, lane = self.g, self.cfg.algo, self.lanes[t]
        prompts = g.prompts(indices)
        hot = g.state.snapshot()
        sampling = {k: hot[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
        split_state.rng_set(lane.rng, self.pl.device)  # only this thread draws: training rank t's stream
        ro = collect(lambda: prompts, self.actor, g.reward, g.tok, sampling=sampling, n=self.cfg.rollout.n,
                     timings=Timings(), overlong=(algo.overlong_buffer, algo.overlong_penalty_factor),
                     rollout_fn=versioned_rollout(self.engine))
        lane.rng = split_state.rng_now(self.pl.device)
        return ro


def serve_streaming(placement: Placement, g, msg: dict) -> int:
    """A generation rank in ``rollout.mode=streaming`` after the first control message (``msg``: the trainers' state
    and data position, its weights following): returns the exit code the training ranks sent."""
    g.follow(msg)
    receive_weights(g.model, placement)
    streamer = _Streamer(placement, g, msg)
    for t, part in split_state.receive_parts(placement, g.served).items():  # a resume: the checkpointed queues
        if part is not None:
            streamer.lanes[t].restore(part, placement.device)
    return streamer.serve()
