"""The job configuration: a tree of dataclasses loaded from YAML plus ``section.key=value`` overrides.

- ``schema``: the fields, each with type, default, range, help, and the SharedState key when hot-updatable
  (``verl_ds.state`` derives its schema from them).
- ``loader``: strict YAML (no duplicate keys, bounded nesting) and per-key checks (``load_config``).
- ``folded``: keys folded into others (issue 32), each refused with its replacement.
- ``model_fields``: ``model.config_overrides``, the HF config fields of the model built from config.
- ``validate``: cross-field rules and the Derived per-rank sizes for a world size.
- ``limits``: this run's limits on hot keys (context length, KL estimator vs placement), shared with SharedState.
- ``startup``: ``check_startup``, the gate that refuses a job before anything is built; ``ports``: its bind check of
  the control server's address.
"""
from .describe import describe
from .fields import ConfigError, Spec, check_value
from .limits import Bound, RunLimits, kl_placement_rule, resolve_kl_kind, run_limits, sequence_tokens
from .loader import load_config, parse_override
from .model_fields import TINY_MODEL, tiny_model_fields
from .schema import (REDACTED, TOKEN_ENV, ActorConfig, AgentConfig, AlgoConfig, Config, CriticConfig, DataConfig,
                     DeepSpeedConfig, ModelConfig, RewardConfig, RolloutConfig, ServerConfig, TrainerConfig,
                     hot_fields, iter_fields, write_run_config)
from .startup import DATA_EXTENSIONS, check_startup, is_loopback
from .validate import STATE_FROM_CONFIG, Derived, initial_state, validate

__all__ = [
    "Config", "ConfigError", "Derived", "load_config", "parse_override", "validate", "check_startup", "describe",
    "initial_state", "STATE_FROM_CONFIG", "run_limits", "sequence_tokens", "RunLimits", "Bound", "kl_placement_rule",
    "resolve_kl_kind", "write_run_config", "REDACTED", "TOKEN_ENV", "DATA_EXTENSIONS", "is_loopback", "Spec",
    "check_value", "TINY_MODEL", "tiny_model_fields", "hot_fields", "iter_fields", "ModelConfig", "DataConfig", "RolloutConfig", "ActorConfig",
    "CriticConfig", "AlgoConfig", "AgentConfig", "RewardConfig", "DeepSpeedConfig", "TrainerConfig", "ServerConfig",
]
