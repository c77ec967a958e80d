"""``model.config_overrides``: the HF config fields of the model built from config (verl's ``override_config``),
checked against the family's config class (an unknown field or a value of another type is a ConfigError naming
``model.config_overrides.<field>``), so a typo cannot silently build another model."""
from __future__ import annotations

from .fields import ConfigError, show, suggest

KEY = "model.config_overrides"
# the built-in model's shape: small enough for CPU tests, Llama/Qwen2 field names
TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}
# sizes a config may ask for (the memory check at start-up then bounds their product on a CPU); a context
# below 8 tokens leaves no room for a prompt and a response
SIZE_RANGES = {"hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 18), "num_hidden_layers": (1, 1 << 10),
               "num_attention_heads": (1, 1 << 10), "num_key_value_heads": (1, 1 << 10),
               "max_position_embeddings": (8, 1 << 20)}
# set from the tokenizer: another value would index past the embedding or stop on the wrong token
FROM_TOKENIZER = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")


def tiny_model_fields(cfg) -> dict:
    """The HF config fields of the model built from config: ``TINY_MODEL`` with ``model.config_overrides`` on top."""
    return {**TINY_MODEL, **cfg.model.config_overrides}


def _config_class(arch: str):
    from transformers import LlamaConfig, Qwen2Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]


def _type_ok(default, value) -> bool:
    if default is None or value is None:
        return True  # optional fields (rope_scaling, head_dim, ...) take what the family takes
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def check_config_overrides(cfg) -> None:
    """Refuse overrides the model cannot take: with ``model.path`` (its config.json is the model), a field the
    ``model.arch`` config class lacks, one the tokenizer sets, a value of the wrong type, or a head count that does
    not divide the hidden size (or the key/value heads the heads)."""
    m = cfg.model
    if not m.config_overrides:
        return
    if m.path is not None:
        raise ConfigError(f"{KEY}: {show(m.config_overrides)} shapes the model built from config, but model.path="
                          f"{m.path!r} is set (its config.json defines the model); expected no overrides with "
                          "model.path (model.config_overrides={} drops a config file's; or edit a copy of its "
                          "config.json)")
    cls = _config_class(m.arch)
    known = cls().to_dict()
    for field, value in m.config_overrides.items():
        if field in FROM_TOKENIZER:
            raise ConfigError(f"{KEY}.{field}: set from the tokenizer (fields {', '.join(FROM_TOKENIZER)}); "
                              "expected it left out")
        if field not in known or field.startswith("_") or field == "transformers_version":
            raise ConfigError(f"{KEY}.{field}: not a field of {cls.__name__} (model.arch={m.arch})"
                              f"{suggest(field, known)}")
        if not _type_ok(known[field], value):
            raise ConfigError(f"{KEY}.{field}: expected {type(known[field]).__name__} like {cls.__name__}'s default "
                              f"{show(known[field])}, got {type(value).__name__} {show(value)}")
    f = tiny_model_fields(cfg)
    for name, (lo, hi) in SIZE_RANGES.items():
        if not lo <= f[name] <= hi:
            raise ConfigError(f"{KEY}.{name}: {show(f[name])} is out of range [{lo}, {hi}]")
    h, heads, kv = f["hidden_size"], f["num_attention_heads"], f["num_key_value_heads"]
    if h % heads:
        raise ConfigError(f"{KEY}: hidden_size={h} must be divisible by num_attention_heads={heads}")
    if heads % kv:
        raise ConfigError(f"{KEY}: num_attention_heads={heads} must be divisible by num_key_value_heads={kv}")
