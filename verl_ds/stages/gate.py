"""The start-up gate of a supervised-style job: the RL job's ``check_startup`` on the keys such a job reads
(docs/stages.md, "Keys"); the RL-only sections are neither used nor checked."""
from __future__ import annotations

import copy

from verl_ds.config import (AgentConfig, AlgoConfig, Config, ConfigError, CriticConfig, Derived, RewardConfig,
                            RolloutConfig, ServerConfig)
from verl_ds.run.checks import check_registry_names
from verl_ds.run.startup import check_startup


def stage_view(cfg: Config) -> Config:
    """``cfg`` with the RL-only sections at their defaults and one "rollout" of ``actor.mini_batch_size`` rows, so
    the RL job's checks (context length, batch arithmetic, paths, device, resume, run directory) apply as they are."""
    view = copy.deepcopy(cfg)
    view.rollout = RolloutConfig(batch_size=cfg.actor.mini_batch_size, max_new_tokens=cfg.rollout.max_new_tokens)
    view.critic = CriticConfig()
    view.algo, view.agent, view.reward, view.server = AlgoConfig(), AgentConfig(), RewardConfig(), ServerConfig()
    view.actor.ppo_epochs = 1
    return view


def check_stage(cfg: Config, world_size: int = 1, rank: int = 0) -> Derived:
    """Refuse a bad supervised job before anything is built (ConfigError naming the key); returns the sizes."""
    check_registry_names(cfg)  # every key's value is checked, as the loader checks the others
    a = cfg.actor
    if a.mini_batch_size % world_size:
        raise ConfigError(f"actor.mini_batch_size={a.mini_batch_size} (rows per optimizer step, summed over ranks) "
                          f"must be divisible by the world size {world_size}")
    per_rank = a.mini_batch_size // world_size
    if per_rank % a.micro_batch_size:
        raise ConfigError(f"actor.micro_batch_size={a.micro_batch_size} must divide the per-rank rows of a step "
                          f"actor.mini_batch_size/world_size = {a.mini_batch_size}/{world_size} = {per_rank}")
    if cfg.data.train_files is None and cfg.data.val_files is not None:
        raise ConfigError("data.val_files is set but data.train_files is not: the built-in task generates both; set "
                          "data.train_files too")
    return check_startup(stage_view(cfg), world_size, rank)
