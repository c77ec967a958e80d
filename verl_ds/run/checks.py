"""The config checked against the package: ``verl_ds.config.validate`` plus the rules that need a registry (the
names of estimators, KL estimators, policy losses and loss aggregations, an estimator's groups, the KL placement,
this run's limits on hot keys, the agent environment, the shipped rewards); ``check_stage_config`` is a supervised
job's counterpart.
No file, device or port: that is ``verl_ds.run.startup``."""
from __future__ import annotations

import dataclasses
from typing import Optional

from verl_ds import algos
from verl_ds.agent.registry import BUILTIN_AGENT_TASKS, environment_class, make_environment
from verl_ds.algos.mismatch import check_mode, parse_rejection
from verl_ds.config import (STATE_FROM_CONFIG, Config, ConfigError, Derived, check_value, kl_placement_rule, validate,
                            validate_stage)
from verl_ds.config.fields import show
from verl_ds.config.model_fields import tiny_model_fields
from verl_ds.config.schema import iter_fields
from verl_ds.rewards import SEQUENCE_REWARDS
from verl_ds.resolved_config import (context_length, initial_state, kl_placement_of, registry_choices,
                                     rope_fixed_length, run_limits)


def check_registry_names(cfg: Config) -> None:
    """Each key that names a registry entry holds a registered name (the loader checks types only: the config
    does not import the registries)."""
    fields = {dotted: (tp, spec) for dotted, tp, spec, _ in iter_fields()}
    for dotted, names in registry_choices().items():
        tp, spec = fields[dotted]
        section, key = dotted.split(".")
        _, why = check_value(tp, getattr(getattr(cfg, section), key), dataclasses.replace(spec, choices=names))
        if why is not None:
            raise ConfigError(f"{dotted}: {why}")


def _check_estimator(cfg: Config) -> None:
    if algos.get_advantage_estimator(cfg.algo.adv_estimator).needs_groups and cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n}: algo.adv_estimator={cfg.algo.adv_estimator} compares the "
                          "responses sampled for the same prompt; with one per prompt every advantage is 0. "
                          "Set rollout.n >= 2")


def _check_mismatch(cfg: Config) -> None:
    """The rollout-mismatch keys agree: a band's low bound only for a mask mode, new modes and bounds only with
    is_correction (decoupled and truncate without it are today's no-ops, kept), criteria that parse."""
    r = cfg.rollout
    if not r.is_correction:
        if r.is_mode not in ("truncate", "decoupled") or r.is_low > 0:
            raise ConfigError(f"rollout.is_mode={r.is_mode}, rollout.is_low={r.is_low}: the importance weights are off "
                              "(rollout.is_correction=false); set rollout.is_correction=true, or leave is_mode and "
                              "is_low at their defaults (is_rejection works alone)")
    else:
        try:
            check_mode(r.is_mode, r.is_cap, r.is_low)
        except ValueError as exc:
            raise ConfigError(f"rollout.is_mode={r.is_mode}, rollout.is_low={r.is_low}: {exc}") from None
    try:
        parse_rejection(r.is_rejection)
    except ValueError as exc:
        raise ConfigError(f"rollout.is_rejection: {exc}") from None


def _check_policy_loss(cfg: Config) -> None:
    try:
        algos.resolve_policy_loss_agg_mode(cfg.algo.policy_loss, cfg.algo.loss_agg_mode, cfg.algo.adv_estimator)
    except ValueError as exc:
        raise ConfigError(f"algo.loss_agg_mode: {exc}") from None


def _check_sequence_rewards(cfg: Config) -> None:
    for i, spec in enumerate(cfg.reward.functions):
        if isinstance(spec, dict) and spec.get("per_token", False) and spec["name"] in SEQUENCE_REWARDS:
            raise ConfigError(f"reward.functions[{i}].per_token: the shipped reward {spec['name']!r} scores whole "
                              "sequences (one float per sample); per_token must be false")


def _check_agent(cfg: Config, world_size: int) -> None:
    """Multi-turn rollouts: the environment loads and takes its arguments, the environment scores (no reward
    functions), the budget fits the model, and what episodes cannot do yet is refused by name."""
    a = cfg.agent
    try:
        environment_class(a.environment)
    except ValueError as exc:
        raise ConfigError(f"agent.environment: {exc}") from None
    try:
        make_environment(a.environment, a.env_args)
    except ValueError as exc:
        raise ConfigError(f"agent.env_args: {exc}") from None
    if cfg.reward.functions or cfg.reward.model_path is not None:
        raise ConfigError(f"agent.environment={a.environment!r}: the environment's rewards score the trajectories; "
                          f"set reward.functions: [] and no reward.model_path (got functions={show(cfg.reward.functions)}"
                          f", model_path={show(cfg.reward.model_path)})")
    if cfg.algo.overlong_buffer:
        raise ConfigError("algo.overlong_buffer: DAPO's overlong penalty is for single responses; with "
                          "agent.environment the limits are agent.max_turns and agent.max_context_tokens (set 0)")
    if cfg.data.train_files is None and a.environment not in BUILTIN_AGENT_TASKS:
        raise ConfigError(f"agent.environment={a.environment!r} has no built-in data set (only "
                          f"{list(BUILTIN_AGENT_TASKS)} do); set data.train_files to rows its reset takes")
    m = cfg.model
    found = ((tiny_model_fields(cfg)["max_position_embeddings"], "model.config_overrides.max_position_embeddings")
             if m.path is None else context_length(m.path))
    if found is not None and a.max_context_tokens > found[0]:
        raise ConfigError(f"agent.max_context_tokens={a.max_context_tokens} is larger than {found[1]}={found[0]}: "
                          "a trajectory must fit the model's context")
    if world_size > 1 and cfg.rollout.engine == "hf" and not cfg.rollout.gather_params:
        raise ConfigError("rollout.gather_params=false: with agent.environment on several ranks each rank runs as many "
                          "generate calls as its own episodes need, and per-token gathering is a collective; set "
                          "rollout.gather_params: true")


def check_config(cfg: Config, world_size: int = 1) -> Derived:
    """``validate(cfg, world_size)``, then the registry names and the rules that need a registry; returns the
    Derived sizes, raises ConfigError naming the key (what ``verl-ds config`` runs without ``--check``)."""
    derived = validate(cfg, world_size)
    check_registry_names(cfg)
    _check_estimator(cfg)
    _check_policy_loss(cfg)
    _check_mismatch(cfg)
    why = kl_placement_rule(kl_placement_of(cfg), cfg.algo.kl_kind)
    if why is not None:
        raise ConfigError(f"algo.kl_kind: {why}")
    limits = run_limits(cfg)
    room = limits.upper.get("max_new_tokens")
    if room is not None and room.max < 1:
        raise ConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length} leaves no room for a response "
                          f"({room.why})")
    state = initial_state(cfg)
    for key, reason in limits.check(state, state).items():
        raise ConfigError(f"{STATE_FROM_CONFIG[key]}: {reason}")
    if cfg.agent.environment is not None:
        _check_agent(cfg, world_size)
    else:
        _check_sequence_rewards(cfg)
    return derived


def _check_row_length(cfg: Config, completion_key: str) -> None:
    """A supervised job's longest row, ``data.max_prompt_length`` plus its completion limit, fits the trained model's
    context and stays where a length-dependent RoPE scaling is fixed: the RL job's rule for its response
    (``run_limits``), on the one model such a job trains."""
    section, name = completion_key.split(".")
    completion, prompt, path = getattr(getattr(cfg, section), name), cfg.data.max_prompt_length, cfg.model.path
    fit = "prompt and completion must fit the model's context"
    limits = []  # (tokens, where, why); on a tie the first listed is named
    if path is None:
        limits.append((tiny_model_fields(cfg)["max_position_embeddings"],
                       "model.config_overrides.max_position_embeddings", fit))
    else:
        rope = rope_fixed_length(path)
        if rope is not None:
            limits.append((rope[0], f"{rope[1]} of model.path {path!r}",
                           f"its rope_scaling type {rope[2]!r} changes every sequence's RoPE frequencies with the "
                           f"longest sequence of a forward past that length, so log-probs would depend on the "
                           f"micro-batch"))
        found = context_length(path)
        if found is not None:
            limits.append((found[0], f"{found[1]} of model.path {path!r}", fit))
    if not limits:
        return
    tokens, where, why = min(limits, key=lambda c: c[0])
    if tokens - prompt < 1:
        raise ConfigError(f"data.max_prompt_length={prompt} leaves no room for a completion ({where}={tokens}: {why})")
    if completion > tokens - prompt:
        raise ConfigError(f"{completion_key}={completion} exceeds this run's limit {tokens - prompt} ({where}={tokens} "
                          f"- data.max_prompt_length={prompt}: {why})")


def check_stage_config(cfg: Config, world_size: int = 1, completion_key: Optional[str] = None) -> Derived:
    """A supervised job's config against the package (``verl-ds sft|rm|dpo``): ``validate_stage``, every registry
    name, and, given the job's completion limit ``completion_key``, its longest row within the model's context.
    Returns the Derived sizes, raises ConfigError naming the key; ``cfg`` is not changed."""
    derived = validate_stage(cfg, world_size)
    check_registry_names(cfg)  # every key's value is checked, as the loader checks the others
    if completion_key is not None:
        _check_row_length(cfg, completion_key)
    return derived
