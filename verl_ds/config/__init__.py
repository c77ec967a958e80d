"""The job configuration, data only: dataclasses loaded from YAML plus ``section.key=value`` overrides (``schema``,
``loader``, ``folded``, ``model_fields``), the cross-field rules and Derived sizes (``validate``) and the hot keys'
run limits (``limits``). It imports nothing of verl_ds outside itself: names that a registry holds and the machine
are checked when the run is built (``verl_ds.run``; docs/config.md).
"""
from .describe import describe
from .fields import ConfigError, Spec, check_value
from .limits import Bound, RunLimits, has_reference, kl_placement_rule, resolve_kl_kind, sequence_tokens
from .loader import load_config, parse_override
from .model_fields import TINY_MODEL, tiny_model_fields
from .schema import (REDACTED, TOKEN_ENV, ActorConfig, AgentConfig, AlgoConfig, Config, CriticConfig, DataConfig,
                     DeepSpeedConfig, DPOConfig, ModelConfig, RewardConfig, RMConfig, RolloutConfig, ServerConfig,
                     SFTConfig, TrainerConfig, hot_fields, is_loopback, iter_fields, write_run_config)
from .validate import STATE_FROM_CONFIG, Derived, validate, validate_stage

__all__ = [
    "Config", "ConfigError", "Derived", "load_config", "parse_override", "validate", "validate_stage", "describe",
    "STATE_FROM_CONFIG",
    "sequence_tokens", "RunLimits", "Bound", "has_reference", "kl_placement_rule", "resolve_kl_kind",
    "write_run_config", "REDACTED", "TOKEN_ENV", "is_loopback", "Spec", "check_value", "TINY_MODEL",
    "tiny_model_fields", "hot_fields", "iter_fields", "ModelConfig", "DataConfig", "RolloutConfig", "ActorConfig",
    "CriticConfig", "AlgoConfig", "AgentConfig", "RewardConfig", "SFTConfig", "RMConfig", "DPOConfig",
    "DeepSpeedConfig", "TrainerConfig", "ServerConfig",
]
