"""Where the trainer's rollouts come from, one interface for every ``rollout.mode`` and placement: ``SyncRollout``
(``rollout.collect`` on the step), ``producer.AsyncRollout`` (a generation thread on this rank: one_step_off,
streaming) and ``split.RemoteRollout`` (generation ranks: ``rollout.split_ranks``). A source reads the run through a
``RolloutRun``, not the trainer; ``split.make_rollout_source`` picks one (docs/async.md, "One rollout source")."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

from verl_ds.metrics import Timings
from verl_ds.rollout import Rollout, collect

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p")


@dataclass
class RolloutRun:
    """What a rollout source reads of the run. ``reward_spec`` and ``needs_baseline`` are read when used: a reward
    swap replaces the spec, and the registry (not a reward object) is held for the same reason."""
    cfg: object
    state: object  # SharedState
    registry: object  # ModelRegistry
    tokenizer: object
    sampler: object  # this rank's DistributedPromptSampler
    train_set: object
    actor_engine: object  # the actor's DeepSpeed engine: its device and module (split placement sends its weights)
    rank: int
    reward_spec: Callable[[], dict]
    needs_baseline: Callable[[], bool]
    rollout_fn: Callable

    @classmethod
    def of(cls, trainer) -> "RolloutRun":
        return cls(cfg=trainer.cfg, state=trainer.state, registry=trainer.registry, tokenizer=trainer.tokenizer,
                   sampler=trainer.c.sampler, train_set=trainer.c.train_set, actor_engine=trainer.actor_engine,
                   rank=trainer.rank, reward_spec=lambda b=trainer.boundary: b.reward_spec,
                   needs_baseline=lambda p=trainer.ppo: p.needs_baseline, rollout_fn=trainer.rollout_fn)

    @property
    def device(self):
        return self.actor_engine.device

    def prompts(self, indices) -> dict:
        """The prompts of these data set indices, collated and on the engines' device."""
        from verl_ds.data import collate_prompts

        return collate_prompts([self.train_set[i] for i in indices], self.tokenizer.pad_token_id, self.device)

    def sampling(self) -> dict:
        """The sampling settings of SharedState now (hot values)."""
        hot = self.state.snapshot()
        return {k: hot[k] for k in SAMPLING_KEYS}


class RolloutSource(abc.ABC):
    """The trainer's rollouts: one per step, new weights after each update, a failed step's prompts given back,
    its part of the checkpoint, and a stop."""

    @abc.abstractmethod
    def next_rollout(self, step: int, timings: Timings) -> Rollout:
        """This rank's rollout for ``step`` (its generation under ``timings``' gen / gen_wait)."""

    @abc.abstractmethod
    def refresh(self) -> None:
        """After an update: the sampler takes the new weights (a collective of the training ranks)."""

    @abc.abstractmethod
    def rewind(self) -> None:
        """The step that failed before any update gives its prompts back (collective), so the fault's checkpoint
        continues with them."""

    def state_dict(self) -> Optional[dict]:
        """The checkpoint's ``"async"`` part (a collective); None: the source has nothing beyond the sampler's."""
        return None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore the checkpoint's ``"async"`` part (None: the checkpoint has none) before the first rollout."""

    def close(self, code: int = 0) -> None:
        """Stop generating (idempotent); split generation ranks exit with ``code``."""


class SyncRollout(RolloutSource):
    """``rollout.mode: sync``: the step's prompts sampled and scored on the step, with this step's hot settings."""

    def __init__(self, run: RolloutRun):
        self.run = run
        self._position: Optional[dict] = None  # the sampler's position before the step's draw (``rewind``)

    def next_rollout(self, step: int, timings: Timings) -> Rollout:
        run, algo = self.run, self.run.cfg.algo
        self._position = run.sampler.state_dict()
        return collect(lambda: run.prompts(run.sampler.next_batch()), run.registry.get("actor"),
                       run.registry.get("reward"), run.tokenizer, sampling=run.sampling(), n=run.cfg.rollout.n,
                       timings=timings, dynamic=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                       overlong=(algo.overlong_buffer, algo.overlong_penalty_factor),
                       greedy_baseline=run.needs_baseline(), rollout_fn=run.rollout_fn)

    def refresh(self) -> None:
        self.run.registry.get("actor").rollout_engine.refresh()

    def rewind(self) -> None:
        self.run.sampler.load_state_dict(self._position)


__all__ = ["RolloutRun", "RolloutSource", "SyncRollout"]
