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


def resolve_kl_placement(kl_placement: str, adv_estimator: str) -> str:
    """``auto`` -> the advantage estimator's convention (in the loss for grpo, dr_grpo and the REINFORCE++ pair, in
    the reward for gae, rloo and remax); ``reward`` and ``loss`` are returned as they are."""
    if kl_placement != "auto":
        return kl_placement
    from verl_ds.algos import get_advantage_estimator  # local: the numerics import torch

    return get_advantage_estimator(adv_estimator).kl_placement


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


@dataclass(frozen=True)
class RunLimits:
    """Limits of one run that hot updates must respect (``SharedState(rank, limits=run_limits(cfg))``)."""
    upper: Mapping[str, Bound] = field(default_factory=dict)
    kl_placement: str = "reward"

    def check(self, values: Mapping, changed: Iterable[str]) -> dict[str, str]:
        """key -> reason for each of the ``changed`` keys whose new value (in ``values``) breaks a limit."""
        errors = {}
        for key in changed:
            bound = self.upper.get(key)
            if bound is not None and values[key] > bound.max:
                errors[key] = f"{values[key]!r} exceeds this run's limit {bound.max} ({bound.why})"
            if key == "kl_kind":
                why = kl_placement_rule(self.kl_placement, values[key])
                if why is not None:
                    errors[key] = why
        return errors


def context_length(model_dir: str) -> Optional[tuple[int, str]]:
    """``(tokens, config key)`` from a local HF model's config.json, or None when it is absent or says none."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            conf = json.load(fh)
    except (OSError, ValueError):
        return None  # a missing or broken model is the start-up checks' business, with a better message
    if not isinstance(conf, dict):
        return None
    for key in _CONTEXT_KEYS:
        value = conf.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def run_limits(cfg) -> RunLimits:
    """This run's limits: the response must fit every model's context after the longest prompt
    (``model.max_position_embeddings`` for the built-in model, config.json for ``model.path``,
    ``model.critic_path`` and ``reward.model_path``), and the KL placement for the estimator rule."""
    m = cfg.model
    contexts = []  # (tokens, where)
    if m.path is None:
        contexts.append((m.max_position_embeddings, "model.max_position_embeddings"))
    for key, path in (("model.path", m.path), ("model.critic_path", m.critic_path),
                      ("reward.model_path", cfg.reward.model_path)):
        found = context_length(path) if path else None
        if found is not None:
            contexts.append((found[0], f"{found[1]} of {key} {path!r}"))
    upper = {}
    if contexts:
        tokens, where = min(contexts)
        prompt = cfg.data.max_prompt_length
        upper["max_new_tokens"] = Bound(tokens - prompt, f"{where}={tokens} - data.max_prompt_length={prompt}: "
                                                          "prompt and response must fit the model's context")
    return RunLimits(upper=upper, kl_placement=resolve_kl_placement(cfg.algo.kl_placement, cfg.algo.adv_estimator))
