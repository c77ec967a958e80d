"""Split placement (``rollout.split_ranks`` > 0): the last ``split_ranks`` ranks only generate, the others train;
the bridge calls of a step, in the order every rank makes them: docs/async.md, "Placement recipes". One_step_off's
generation ranks are here, streaming's in ``split_stream``; ``placement`` makes the groups and moves the weights.
A generation rank that dies or hangs fails the training ranks' receive within ``trainer.dist_timeout_s``."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from verl_ds.asyncrl.bridge import _REQUEST, _STOP, _WEIGHTS, _control, _recv_obj, send_rollout
from verl_ds.asyncrl.placement import Placement, receive_weights, send_weights
from verl_ds.asyncrl.source import RolloutRun, RolloutSource, SyncRollout
from verl_ds.asyncrl.split_state import gather_states, restore_part, send_part
from verl_ds.metrics import Timings
from verl_ds.rollout import Rollout, collect

log = logging.getLogger(__name__)
_current: dict = {}  # the process's Placement, set by ``verl-ds train`` before the Trainer is built


def set_current(placement: Placement) -> None:
    _current["placement"] = placement


def current():
    return _current.get("placement")


class RemoteRollout(RolloutSource):
    """The training ranks' side: ``next_rollout`` receives the batch, ``refresh`` sends the weights."""

    def __init__(self, run: RolloutRun, placement: Placement):
        self.run, self.pl = run, placement
        self.src = placement.n_train + run.rank % (placement.world - placement.n_train)
        self._started, self._closed = False, False
        self._restore, self._broken = None, False  # the part to send at the start (a resume); the bridge failed
        self._position = None  # the sampler's position before the step's draw (``rewind``)

    def _payload(self) -> dict:
        run = self.run
        # the whole SharedState (values and version) and the active reward: every hot change applied at this step
        # boundary reaches the generation ranks with the request for the batch they make next
        return {"state": run.state.state_dict(), "reward_spec": dict(run.reward_spec()),
                "step": int(run.state.get("global_step")), "samplers": run.sampler.state_dict()}

    def _send(self) -> None:
        _control(self.pl.bridge, _WEIGHTS, payload=self._payload())
        send_weights(self.run.actor_engine.module, self.pl)

    def next_rollout(self, step: int, timings: Timings) -> Rollout:
        self._position = self.run.sampler.state_dict()
        with timings("gen_wait"):
            try:
                if not self._started:  # the generation ranks start from this run's weights and data position
                    self._send()
                    if self.run.cfg.rollout.mode == "streaming":  # the generation rank's queues as of the checkpoint
                        send_part(self.pl, self.src, self._restore)
                    self._started = True
                self.run.sampler.next_batch()  # in step with what was generated for this rank (checkpoints)
                _control(self.pl.bridge, _REQUEST, payload=self._payload())  # the batch made ahead; start the next
                msg = _recv_obj(self.pl.bridge, self.src)
            except RuntimeError as exc:  # gloo: the peer closed the connection, or the bridge's timeout passed
                from verl_ds.asyncrl.queue import ProducerError

                self._broken = True
                raise ProducerError(f"generation rank {self.src} (rollout.split_ranks) sent no batch: it died, hangs "
                                    f"or failed (its log says why): {str(exc).splitlines()[0]}") from None
        from verl_ds.batch import RolloutBatch

        device = self.run.device
        batch = RolloutBatch(extras=msg["extras"], **msg["fields"]).to(device)
        return Rollout(batch=batch, responses=msg["responses"], metrics=msg["metrics"],
                       per_sample={k: v.to(device) for k, v in msg["per_sample"].items()})

    def refresh(self) -> None:
        """After the update: the weights go to the generation ranks (a collective of every rank)."""
        t0 = time.perf_counter()
        self._send()
        self.run.registry.get("actor").rollout_engine.refresh()  # validation samples on this rank's replica
        self.sync_s = time.perf_counter() - t0

    def rewind(self) -> None:
        """The trainers' data position goes back (the generation ranks' queues are saved as they are)."""
        self.run.sampler.load_state_dict(self._position)

    def state_dict(self) -> dict:
        """The generation ranks' queues, in the colocated format (a collective of every rank: ``split_state``)."""
        return gather_states(self.pl, self.src, self.run.cfg.rollout.mode, self.run.sampler,
                             self._restore, self._started, self._broken)

    def load_state_dict(self, state) -> None:
        """Keep this rank's part of ``state`` (at this world size, or dealt by ``reshard``) for the generation rank."""
        if state is not None:  # a synchronous run's checkpoint: the generation ranks start from the data position
            self._restore = restore_part(state, self.run.cfg.rollout, self.run.sampler, self.run.device)

    def close(self, code: int = 0) -> None:
        """Tell the generation ranks to stop (every training rank calls it, at the end or on a failure)."""
        if self._closed:
            return
        self._closed = True
        try:
            _control(self.pl.bridge, _STOP, code)
        except RuntimeError as exc:  # a generation rank is gone already
            log.warning("split placement: could not stop the generation ranks: %s", str(exc).splitlines()[0])


def _setup(cfg, placement: Placement, data) -> SimpleNamespace:
    """A generation rank's model, reward, SharedState and the samplers of the training ranks it serves."""
    from verl_ds.builder import build_reward
    from verl_ds.config.validate import validate
    from verl_ds.data import collate_prompts
    from verl_ds.engines.build import build_actor_model
    from verl_ds.models import PolicyModel
    from verl_ds.sampler import DistributedPromptSampler
    from verl_ds.state import SharedState

    n_gen = placement.world - placement.n_train
    me = placement.rank - placement.n_train
    g = SimpleNamespace(cfg=cfg, data=data, tok=data.tokenizer, state=SharedState(rank=0),
                        served=[t for t in range(placement.n_train) if t % n_gen == me],
                        derived=validate(cfg, placement.n_train), rank=placement.rank)
    g.model = build_actor_model(cfg, g.tok).to(placement.device)
    engine = None
    if cfg.rollout.engine != "hf":  # vLLM (one_step_off): started from this replica, refreshed after each receive
        from verl_ds.rollout_engines import build_rollout_engine

        engine = build_rollout_engine(cfg, g.model, g.tok, state=g.state, rank=placement.rank)
    g.actor = PolicyModel(g.model, state=g.state, rollout_engine=engine)
    g.spec = {"functions": list(cfg.reward.functions), "model_path": cfg.reward.model_path,
              "model_weight": cfg.reward.model_weight}  # the trainer's StepBoundary starts from the same spec
    g.reward = build_reward(cfg, g.tok, g.derived, state=g.state)
    g.samplers = {t: DistributedPromptSampler(len(data.train), g.derived.prompts_per_rank, t, placement.n_train,
                                              seed=cfg.trainer.seed) for t in g.served}

    def follow(msg) -> None:
        """Take the training ranks' SharedState and reward as of their latest step boundary."""
        g.state.load_state_dict(msg["state"])
        if msg["reward_spec"] != g.spec:  # swapped (or restored on resume): built and tried by the trainers
            s, old = msg["reward_spec"], g.reward
            getattr(old, "close", lambda: None)()
            g.reward = build_reward(cfg, g.tok, g.derived, s["functions"], s.get("model_path"), s.get("model_weight"),
                                    state=g.state)
            g.spec = s
            log.info("generation rank %d: reward swapped to %s at step %d", placement.rank, s, msg["step"])

    g.follow = follow
    g.prompts = lambda indices: collate_prompts([data.train[i] for i in indices], g.tok.pad_token_id,
                                                placement.device)
    return g


def run_generation_rank(cfg, placement: Placement, data) -> int:
    """A generation rank's whole life (streaming: ``split_stream``); returns the exit code the training ranks sent."""
    from verl_ds.runtime.preemption import PreemptionHandler

    # a preemption signal sent to every task: the training ranks checkpoint (with this rank's queues) and stop it
    PreemptionHandler().install()
    g = _setup(cfg, placement, data)
    cmd, code, msg = _control(placement.bridge)  # the first weights and the data position
    if cmd == _STOP:
        return code
    for t in g.served:
        g.samplers[t].load_state_dict(msg["samplers"])
    if cfg.rollout.mode == "streaming":
        from verl_ds.asyncrl.split_stream import serve_streaming

        return serve_streaming(placement, g, msg)

    def generate(msg) -> dict:
        g.follow(msg)
        hot, out = g.state.snapshot(), {}
        sampling = {k: hot[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
        for t in g.served:
            prompts = g.prompts(g.samplers[t].next_batch())
            t0 = time.perf_counter()
            ro = collect(lambda: prompts, g.actor, g.reward, g.tok, sampling=sampling, n=cfg.rollout.n,
                         timings=Timings(), overlong=(cfg.algo.overlong_buffer, cfg.algo.overlong_penalty_factor))
            ro.metrics.update({"async/generated_at_step": torch.tensor(float(msg["step"])),
                               "async/state_version": torch.tensor(float(g.state.version)),
                               "async/gen_busy_s": torch.tensor(time.perf_counter() - t0)})
            out[t] = ro
        return out

    ready = None
    while True:
        if cmd == _STOP:
            return code
        if cmd == _WEIGHTS:
            receive_weights(g.model, placement)
            g.actor.rollout_engine.refresh()
            if ready is None:  # the first batch, right after the first weights
                ready = generate(msg)
        elif cmd == _REQUEST:  # send the batch made ahead, then make the next one while the trainers train
            for t, ro in ready.items():
                send_rollout(placement, ro, t)
            ready = generate(msg)
        cmd, code, msg = _control(placement.bridge)


def start(cfg, launch, data):
    """``verl-ds train`` with ``rollout.split_ranks``: make the groups; a generation rank runs its loop and returns
    (launch, its exit code), a training rank returns (its launch info within the training ranks' world, None)."""
    import dataclasses

    from verl_ds.asyncrl.placement import rank_device, split_groups, weight_backend

    device = rank_device(cfg.trainer.device, launch.local_rank)
    pl = split_groups(launch.rank, launch.world_size, launch.master_addr, launch.master_port,
                      cfg.rollout.split_ranks, cfg.trainer.dist_timeout_s, device=device)
    if pl.role == "rollout":
        code = run_generation_rank(cfg, pl, data)
        if code:  # the training ranks failed or were preempted: the job's launcher sees it from every rank
            log.warning("split placement: the training ranks stopped with exit code %d; generation rank %d exits "
                        "with it", code, launch.rank)
        return launch, code
    import deepspeed

    # DeepSpeed's comm on the training ranks' group, made above (nccl on CUDA)
    deepspeed.init_distributed(dist_backend=weight_backend(device))
    set_current(pl)
    return dataclasses.replace(launch, world_size=pl.n_train), None


def make_rollout_source(run: RolloutRun) -> RolloutSource:
    """The source for ``rollout.mode`` and placement: generation ranks, a generation thread, or the step itself."""
    if run.cfg.rollout.split_ranks:
        return RemoteRollout(run, current())
    if run.cfg.rollout.mode == "sync":
        return SyncRollout(run)
    from verl_ds.asyncrl.producer import AsyncRollout

    return AsyncRollout(run)
