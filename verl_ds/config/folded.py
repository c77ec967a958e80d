"""Keys folded into others (fewer keys, the same features). A config that still sets one is refused
(exit 2) with the key that replaces it and what to write there for the value it gave, never ignored."""
from __future__ import annotations

from typing import Any, Callable

from .fields import show


def _override(field: str) -> Callable[[Any], str]:
    return lambda v: f"model.config_overrides.{field}={show(v)} (HF config field {field})"


def _member(key: str, item: str) -> Callable[[Any], str]:
    return lambda v: (f"list {item} in {key}" if v is True else f"leave {item} out of {key}" if v is False
                      else f"{item} in {key} or not (true/false went there)")


def _actor(name: str, what: str) -> Callable[[Any], str]:
    return lambda v: f"actor.{name} (the critic uses the actor's {what}; got {show(v)})"


# old key -> (the key that replaces it, what to write for the old value)
FOLDED_KEYS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "model.hidden_size": ("model.config_overrides", _override("hidden_size")),
    "model.intermediate_size": ("model.config_overrides", _override("intermediate_size")),
    "model.num_layers": ("model.config_overrides", _override("num_hidden_layers")),
    "model.num_heads": ("model.config_overrides", _override("num_attention_heads")),
    "model.num_kv_heads": ("model.config_overrides", _override("num_key_value_heads")),
    "model.max_position_embeddings": ("model.config_overrides", _override("max_position_embeddings")),
    "trainer.progress_bar": ("trainer.loggers", _member("trainer.loggers", "progress_bar")),
    "trainer.plot": ("trainer.loggers", _member("trainer.loggers", "plot")),
    "trainer.tensorboard": ("trainer.loggers", _member("trainer.loggers", "tensorboard")),
    "trainer.wandb": ("trainer.loggers", _member("trainer.loggers", "wandb")),
    "critic.lora_alpha": ("actor.lora_alpha", _actor("lora_alpha", "LoRA alpha")),
    "critic.lora_dropout": ("actor.lora_dropout", _actor("lora_dropout", "LoRA dropout")),
    "critic.lora_target_modules": ("actor.lora_target_modules",
                                   _actor("lora_target_modules", "target modules, less output-head")),
    "critic.micro_batch_size": ("actor.micro_batch_size", _actor("micro_batch_size", "micro-batch size")),
    "critic.max_tokens_per_micro_batch": ("actor.max_tokens_per_micro_batch",
                                          _actor("max_tokens_per_micro_batch", "token budget")),
    "trainer.export_hf": ("trainer.export", lambda v: "trainer.export=none" if v is False
                          else "trainer.export=merged (or adapter)"),
    "trainer.export_format": ("trainer.export", lambda v: f"trainer.export={show(v)}"),
    "deepspeed.offload_optimizer": ("deepspeed.offload", _member("deepspeed.offload", "optimizer")),
    "deepspeed.offload_param": ("deepspeed.offload", _member("deepspeed.offload", "param")),
    "rollout.share_prefill": ("rollout.share", lambda v: "rollout.share=none" if v is False
                              else "rollout.share=prefill (or decode, the default, which shares the prefill too)"),
    "rollout.share_decode": ("rollout.share", lambda v: "rollout.share=prefill" if v is False
                             else "rollout.share=decode (the default)"),
}


def folded_message(key: str, value: Any) -> str:
    """The refusal for folded ``key`` given ``value``: the key, its replacement and what to write there."""
    new, hint = FOLDED_KEYS[key]
    return f"{key} was folded into {new}: use {hint(value)}"
