"""The config resolved against the package's registries: the names the registry keys may take, ``auto`` resolved
for the advantage estimator, SharedState's values at step 0 and this run's limits on hot keys (docs/config.md).
It sits below SharedState and the run, which both take these."""
from __future__ import annotations

import json
import os
from typing import Optional

from verl_ds import algos
from verl_ds.config import (STATE_FROM_CONFIG, Bound, Config, RunLimits, has_reference, resolve_kl_kind,
                            tiny_model_fields)

# config.json keys holding a model's context length, by architecture family
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def registry_choices() -> dict[str, tuple]:
    """Config key -> the names its registry holds now; the config stores these keys as plain strings."""
    return {"algo.adv_estimator": tuple(algos.ADV_ESTIMATOR_NAMES), "algo.kl_kind": tuple(algos.KL_KINDS),
            "algo.loss_agg_mode": tuple(algos.LOSS_AGG_MODES), "algo.policy_loss": tuple(algos.POLICY_LOSS_NAMES)}


def kl_placement_of(cfg: Config) -> str:
    """Where this config puts the KL term: ``algo.kl_placement`` with ``auto`` resolved ("reward" or "loss")."""
    return algos.resolve_kl_placement(cfg.algo.kl_placement, cfg.algo.adv_estimator)


def initial_state(cfg: Config) -> dict:
    """SharedState's hot values at step 0, from the config (kl_kind resolved, use_kl_penalty effective)."""
    out = {}
    for key, dotted in STATE_FROM_CONFIG.items():
        section, name = dotted.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    out["kl_kind"] = resolve_kl_kind(cfg.algo.kl_kind, kl_placement_of(cfg))
    out["use_kl_penalty"] = cfg.algo.use_kl_penalty and has_reference(cfg)
    return out


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


def run_limits(cfg) -> RunLimits:
    """This run's limits: the response must fit every model's context after the longest prompt
    (``max_position_embeddings`` of ``model.config_overrides`` for the built-in model, config.json for ``model.path``,
    ``model.critic_path`` and ``reward.model_path``) and stay where a length-dependent RoPE scaling is fixed
    (``rope_fixed_length``), and the KL placement for the estimator rule."""
    m = cfg.model
    fit = "prompt and response must fit the model's context"
    contexts = []  # (tokens, where, why); on a tie the first listed is named
    if m.path is None:
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
    return RunLimits(upper=upper, kl_placement=kl_placement_of(cfg), reference=has_reference(cfg))
