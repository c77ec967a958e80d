"""Per-run limits on hot hyper-parameters, shared by config validation and SharedState's hot updates.

Static ranges live on each field's Spec; these are the limits that depend on the run: the response length
that fits the model's context, and the KL estimator the chosen KL placement can use.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

# KL estimators whose gradient has zero expectation under the policy's own samples:
# grad E_{y~pi}[log pi(y) - log pi_ref(y)] with y held fixed = E_{y~pi}[grad log pi(y)] = 0 (the score function
# identity), so as a loss term they regularise nothing (Schulman, "Approximating KL Divergence", 2020).
ZERO_GRADIENT_KL = ("k1", "kl")
# the exact full-vocabulary KL (verl_ds.models.full_kl): needs the actor's LM head, so the loss only
FULL_KL_KIND = "full_symmetric"
LOSS_KL_DEFAULT = "low_var_kl"
REWARD_KL_DEFAULT = "k1"
# config.json keys holding a model's context length, by architecture family
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def kl_placement_rule(kl_placement: str, kl_kind: str) -> Optional[str]:
    """Why ``kl_kind`` cannot be used at ``kl_placement``, or None when it can."""
    if kl_placement == "loss" and kl_kind in ZERO_GRADIENT_KL:
        return (f"{kl_kind!r} in the loss (algo.kl_placement=loss) regularises nothing: the gradient of "
                f"k1 = log(pi/pi_ref) has zero expectation under the policy's own samples; use low_var_kl (k3, "
                f"the default for the loss) or k2 (mse), or put the KL in the reward")
    if kl_placement == "reward" and kl_kind == FULL_KL_KIND:
        return (f"{kl_kind!r} is computed over the whole vocabulary from the actor's LM head during its update, so "
                f"it can only be a loss term: set algo.kl_placement=loss, or use 'symmetric' (its sampled-token "
                f"estimate) in the reward")
    return None


def _estimator_default(value: str, adv_estimator: str, attr: str) -> str:
    if value != "auto":
        return value
    from verl_ds.algos import get_advantage_estimator  # local: the numerics import torch

    return getattr(get_advantage_estimator(adv_estimator), attr)


def resolve_kl_placement(kl_placement: str, adv_estimator: str) -> str:
    """``auto`` -> the advantage estimator's convention (in the loss for grpo, dr_grpo and the REINFORCE++ pair, in
    the reward for gae, rloo and remax); ``reward`` and ``loss`` are returned as they are."""
    return _estimator_default(kl_placement, adv_estimator, "kl_placement")


def resolve_loss_agg_mode(loss_agg_mode: str, adv_estimator: str) -> str:
    """``auto`` -> the advantage estimator's aggregation (seq-mean-token-sum-norm for dr_grpo, token-mean for the
    others); any other mode is returned as it is."""
    return _estimator_default(loss_agg_mode, adv_estimator, "loss_agg_mode")


def resolve_kl_kind(kl_kind: str, kl_placement: str) -> str:
    """``auto`` -> k1 in the reward, low_var_kl in the loss; any other name is returned as it is."""
    if kl_kind != "auto":
        return kl_kind
    return LOSS_KL_DEFAULT if kl_placement == "loss" else REWARD_KL_DEFAULT


@dataclass(frozen=True)
class Bound:
    """An inclusive upper limit on a hot key for this run, and why."""
    max: float
    why: str


def has_reference(cfg) -> bool:
    """Whether a run builds a frozen reference: only then can a KL term be non-zero (``algo.kl_coef > 0`` or an
    adaptive KL controller at start-up)."""
    from verl_ds.algos.kl_ctrl import KL_CONTROLLERS  # local: the numerics import torch

    return cfg.algo.kl_coef > 0 or KL_CONTROLLERS.canonical(cfg.algo.kl_ctrl) != "fixed"


# hot key -> (whether a value turns a KL term on, the value that keeps it off)
_KL_SWITCHES = {"kl_coef": (lambda v: v > 0, 0.0), "use_kl_penalty": (lambda v: v is True, False),
                "kl_ctrl_type": (lambda v: v != "fixed", "fixed")}
_NO_REFERENCE = ("this run has no reference model (it started with algo.kl_coef=0 and algo.kl_ctrl=fixed), so no KL "
                 "term can be turned on")


@dataclass(frozen=True)
class RunLimits:
    """Limits of one run that hot updates must respect (``SharedState(rank, limits=run_limits(cfg))``).
    ``reference``: whether the run built a frozen reference (without one, KL keys cannot turn a KL term on)."""
    upper: Mapping[str, Bound] = field(default_factory=dict)
    kl_placement: str = "reward"
    reference: bool = True

    def check(self, values: Mapping, changed: Iterable[str]) -> dict[str, str]:
        """key -> reason for each of the ``changed`` keys whose new value (in ``values``) breaks a limit."""
        errors = {}
        for key in changed:
            if not self.reference and key in _KL_SWITCHES and _KL_SWITCHES[key][0](values[key]):
                errors[key] = (f"{values[key]!r} refused: {_NO_REFERENCE}; {key} must stay {_KL_SWITCHES[key][1]!r} "
                               "(restart with algo.kl_coef > 0 or an adaptive algo.kl_ctrl for a KL term)")
            bound = self.upper.get(key)
            if bound is not None and values[key] > bound.max:
                errors[key] = f"{values[key]!r} exceeds this run's limit {bound.max} ({bound.why})"
            if key == "kl_kind":
                why = kl_placement_rule(self.kl_placement, values[key])
                if why is not None:
                    errors[key] = why
        return errors


def _config_json(model_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            conf = json.load(fh)
    except (OSError, ValueError):
        return None  # a missing or broken model is the start-up checks' business, with a better message
    return conf if isinstance(conf, dict) else None


def rope_fixed_length(model_dir: str) -> Optional[tuple[int, str, str]]:
    """``(tokens, length key, rope type)`` when a local HF model's config.json has a RoPE scaling whose frequencies
    follow the longest sequence of a forward, with the length up to which they stay fixed; else None.

    transformers' ``dynamic_rope_update`` recomputes them from max(position_ids) + 1 of the whole batch: ``dynamic``
    types rescale past ``max_position_embeddings``, ``longrope`` switches to its long factors past
    ``original_max_position_embeddings``. Past that length a sequence's log-probs depend on its micro-batch."""
    conf = _config_json(model_dir)
    if conf is None:
        return None
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4 / 5 spelling
        params = conf.get(key)
        if not isinstance(params, dict) or not params:
            continue
        per_layer = all(isinstance(v, dict) for v in params.values())  # {layer type: parameters}
        for p in (params.values() if per_layer else [params]):
            kind = p.get("rope_type") or p.get("type")
            if not isinstance(kind, str):
                continue
            if "dynamic" in kind:
                length_key, tokens = "max_position_embeddings", conf.get("max_position_embeddings")
            elif kind == "longrope":
                length_key = "original_max_position_embeddings"
                tokens = p.get(length_key) or conf.get(length_key) or conf.get("max_position_embeddings")
            else:
                continue
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
                return tokens, length_key, kind
    return None


def context_length(model_dir: str) -> Optional[tuple[int, str]]:
    """``(tokens, config key)`` from a local HF model's config.json, or None when it is absent or says none."""
    conf = _config_json(model_dir)
    if conf is None:
        return None
    for key in _CONTEXT_KEYS:
        value = conf.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def sequence_tokens(cfg) -> int:
    """The most tokens one sample can hold: a multi-turn trajectory's ``agent.max_context_tokens``, else the
    longest prompt and response."""
    if cfg.agent.environment is not None:
        return cfg.agent.max_context_tokens
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def run_limits(cfg) -> RunLimits:
    """This run's limits: the response must fit every model's context after the longest prompt
    (``max_position_embeddings`` of ``model.config_overrides`` for the built-in model, config.json for ``model.path``,
    ``model.critic_path`` and ``reward.model_path``) and stay where a length-dependent RoPE scaling is fixed
    (``rope_fixed_length``), and the KL placement for the estimator rule."""
    m = cfg.model
    fit = "prompt and response must fit the model's context"
    contexts = []  # (tokens, where, why); on a tie the first listed is named
    if m.path is None:
        from .model_fields import tiny_model_fields

        contexts.append((tiny_model_fields(cfg)["max_position_embeddings"], "model.config_overrides.max_position_embeddings",
                         fit))
    for key, path in (("model.path", m.path), ("model.critic_path", m.critic_path),
                      ("reward.model_path", cfg.reward.model_path)):
        rope = rope_fixed_length(path) if path else None
        if rope is not None:
            contexts.append((rope[0], f"{rope[1]} of {key} {path!r}",
                             f"its rope_scaling type {rope[2]!r} changes every sequence's RoPE frequencies with the "
                             f"longest sequence of a forward past that length, so log-probs would depend on the "
                             f"micro-batch"))
        found = context_length(path) if path else None
        if found is not None:
            contexts.append((found[0], f"{found[1]} of {key} {path!r}", fit))
    upper = {}
    if contexts:
        tokens, where, why = min(contexts, key=lambda c: c[0])
        if cfg.agent.environment is not None:  # a turn must fit the trajectory's budget, which must fit the model
            budget = min(tokens, cfg.agent.max_context_tokens)
            upper["max_new_tokens"] = Bound(budget - 1, f"agent.max_context_tokens={cfg.agent.max_context_tokens} "
                                                        f"and {where}={tokens}, less one prompt token: {why}")
        else:
            prompt = cfg.data.max_prompt_length
            upper["max_new_tokens"] = Bound(tokens - prompt, f"{where}={tokens} - data.max_prompt_length={prompt}: "
                                                             f"{why}")
    return RunLimits(upper=upper, kl_placement=resolve_kl_placement(cfg.algo.kl_placement, cfg.algo.adv_estimator),
                     reference=has_reference(cfg))
