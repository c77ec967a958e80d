"""The job configuration: a tree of dataclasses, loaded from YAML plus ``section.key=value`` overrides.

Every field carries its one line of help (``help=``) so ``verl-ds config --help`` and docs/config.md
come from one place. Unknown keys, wrong types and out-of-range values fail before anything is
built, naming the key; ``validate`` checks the batch arithmetic for a given world size.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """An invalid configuration: the message names the key, what was expected and what was found."""


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    path: Optional[str] = _f(None, "Local HF causal LM directory for the actor (and ref/critic backbone). None: build a tiny model from the fields below.")
    critic_path: Optional[str] = _f(None, "Local HF directory for the critic backbone; None: same as `path` (or the tiny config).")
    tokenizer_path: Optional[str] = _f(None, "Local tokenizer directory; None: the model path's tokenizer, or the built-in word-level tokenizer.")
    arch: Literal["llama", "qwen2"] = _f("llama", "Architecture of the model built from config when `path` is None.")
    hidden_size: int = _f(64, "Hidden size of the model built from config.", min=1)
    intermediate_size: int = _f(128, "MLP size of the model built from config.", min=1)
    num_layers: int = _f(2, "Layers of the model built from config.", min=1)
    num_heads: int = _f(4, "Attention heads of the model built from config.", min=1)
    num_kv_heads: int = _f(2, "Key/value heads of the model built from config.", min=1)
    max_position_embeddings: int = _f(256, "Context length of the model built from config.", min=8)
    pad_is_eos: bool = _f(False, "Built-in tokenizer only: make pad == eos (a common real-world setup) to exercise that path.")
    dtype: Literal["fp32", "bf16"] = _f("fp32", "Parameter / compute dtype of actor, critic and reference engines.")
    gradient_checkpointing: bool = _f(False, "Activation checkpointing in actor and critic (HF gradient_checkpointing_enable).")
    init_seed: int = _f(1234, "Seed for the weights of models built from config (identical on every rank).")


@dataclass
class DataConfig:
    train_files: Optional[str] = _f(None, "Prompt file (.jsonl, .parquet, or a datasets save_to_disk dir). None: the built-in parity task, generated.")
    val_files: Optional[str] = _f(None, "Held-out prompt file for validation; None with the built-in task: a generated held-out set.")
    prompt_key: str = _f("prompt", "Field holding the prompt text.")
    passthrough_keys: list = _f([], "Extra fields passed to reward functions in batch.extras (e.g. ['answer']).")
    max_prompt_length: int = _f(32, "Prompt token limit.", min=1)
    overlong: Literal["truncate", "skip"] = _f("truncate", "What to do with prompts longer than max_prompt_length (counted either way).")
    apply_chat_template: bool = _f(False, "Wrap each prompt as a user message with the tokenizer's chat template.")
    num_train_prompts: int = _f(4096, "Built-in task only: number of generated training prompts.", min=1)
    num_val_prompts: int = _f(64, "Built-in task only: number of generated held-out prompts.", min=1)


@dataclass
class RolloutConfig:
    batch_size: int = _f(32, "Prompts per PPO step, summed over data-parallel ranks.", min=1)
    max_new_tokens: int = _f(8, "Initial response token limit (hot-updatable via SharedState).", min=1)
    temperature: float = _f(1.0, "Initial sampling temperature (hot-updatable).", gt=0.0)
    top_k: int = _f(0, "Initial top-k (0 disables; hot-updatable).", min=0)
    top_p: float = _f(1.0, "Initial top-p (1.0 disables; hot-updatable).", gt=0.0, max=1.0)
    log_prob_micro_batch_size: int = _f(64, "Samples per rank in one no-grad forward (old/ref log-probs, values, validation).", min=1)
    gather_params: bool = _f(True, "Gather the actor's ZeRO-3 parameters once per generate call into a replica (fast); False: per-token gathering under synced_gpus.")


@dataclass
class ActorConfig:
    lr: float = _f(1e-3, "Initial actor learning rate (hot-updatable).", gt=0.0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", min=0.0)
    grad_clip: float = _f(1.0, "Gradient clipping by global norm (0 disables).", min=0.0)
    ppo_epochs: int = _f(1, "Passes over each rollout batch.", min=1)
    mini_batch_size: int = _f(32, "Samples per optimizer step, summed over ranks; divides rollout.batch_size.", min=1)
    micro_batch_size: int = _f(16, "Samples per forward/backward on one rank (gradient accumulation fills the mini-batch).", min=1)
    sft_warmup_steps: int = _f(0, "Supervised warm-up steps on the task's reference responses before PPO (built-in task only).", min=0)


@dataclass
class CriticConfig:
    lr: float = _f(5e-3, "Initial critic learning rate (hot-updatable).", gt=0.0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", min=0.0)
    grad_clip: float = _f(1.0, "Gradient clipping by global norm (0 disables).", min=0.0)
    ppo_epochs: int = _f(1, "Critic passes over each rollout batch.", min=1)
    cliprange_value: float = _f(0.5, "Initial value clip range (hot-updatable; 0 disables).", min=0.0)


@dataclass
class AlgoConfig:
    gamma: float = _f(1.0, "Discount (hot-updatable).", min=0.0, max=1.0)
    lam: float = _f(0.95, "GAE lambda (hot-updatable).", min=0.0, max=1.0)
    kl_placement: Literal["reward", "loss"] = _f("reward", "Where the KL penalty goes: subtracted from the token rewards, or added to the actor loss.")
    kl_kind: str = _f("k1", "KL estimator: k1|kl, abs, k2|mse, k3|low_var_kl, symmetric (hot-updatable).")
    kl_coef: float = _f(0.01, "Initial KL coefficient (hot-updatable).", min=0.0)
    kl_ctrl: Literal["fixed", "adaptive", "multiplicative"] = _f("fixed", "KL controller: fixed, adaptive (Ziegler et al.) or multiplicative (x1.5 / x0.8 band rule).")
    target_kl: float = _f(0.1, "Target per-token KL of the adaptive controllers.", gt=0.0)
    kl_horizon: int = _f(10000, "Horizon of the adaptive (Ziegler) controller.", min=1)
    clip_ratio_low: float = _f(0.2, "PPO clip epsilon below 1 (hot-updatable).", min=0.0, max=1.0)
    clip_ratio_high: float = _f(0.2, "PPO clip epsilon above 1 (hot-updatable).", min=0.0)
    clip_ratio_c: Optional[float] = _f(3.0, "Dual-clip constant for negative advantages (> 1; null disables).")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (hot-updatable).", min=0.0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = _f(
        "token-mean", "How per-token losses are aggregated (exact across ranks and accumulation).")
    whiten_advantages: bool = _f(True, "Whiten advantages with statistics global across data-parallel ranks.")


@dataclass
class RewardConfig:
    functions: list = _f(["parity"], "Reward functions: shipped names (parity, exact_match, ...) or 'module:fn' / 'file.py:fn'; entries may be {name, weight, per_token}.")
    model_path: Optional[str] = _f(None, "Local HF sequence-classification reward model (1 label), scored at the last real token.")
    model_weight: float = _f(1.0, "Weight of the neural reward in the sum.")
    eos_reward: Literal["zero", "keep"] = _f("zero", "Per-token rewards at the EOS position: zeroed or kept.")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = _f(3, "ZeRO stage of actor and critic (0-3); the reference is always an inference engine.", min=0, max=3)
    offload_optimizer: bool = _f(False, "Offload optimizer state to CPU.")
    offload_param: bool = _f(False, "Offload parameters to CPU (ZeRO-3 only).")
    stage3_max_live_parameters: int = _f(1_000_000_000, "ZeRO-3 max_live_parameters.", min=0)
    stage3_max_reuse_distance: int = _f(1_000_000_000, "ZeRO-3 max_reuse_distance (0 forces re-gathering; used by the no-hang test).", min=0)
    stage3_prefetch_bucket_size: int = _f(50_000_000, "ZeRO-3 prefetch bucket size.", min=0)
    stage3_param_persistence_threshold: int = _f(100_000, "ZeRO-3 parameter persistence threshold.", min=0)
    config_file: Optional[str] = _f(None, "A DeepSpeed JSON whose entries override the generated ones (batch sizes stay derived).")


@dataclass
class TrainerConfig:
    total_steps: int = _f(150, "PPO steps to run.", min=1)
    output_dir: str = _f("runs/default", "Run directory: metrics, checkpoints, the HF export.")
    resume: str = _f("auto", "auto (latest complete checkpoint in output_dir, if any) | none | a checkpoint directory.")
    seed: int = _f(0, "Seed for data order, sampling and every rank's RNG.")
    save_every: int = _f(0, "Checkpoint every N steps (0: only at the end).", min=0)
    keep_last: int = _f(2, "Checkpoints kept (older ones are deleted).", min=1)
    val_every: int = _f(0, "Greedy validation on the held-out prompts every N steps (0: start and end only).", min=0)
    export_hf: bool = _f(True, "Export the trained actor with save_pretrained (safetensors) at the end.")
    progress_bar: bool = _f(True, "Show a tqdm progress bar on rank 0.")
    plot: bool = _f(True, "Write reward_curve.png at the end (needs matplotlib).")
    tensorboard: bool = _f(False, "Also log to TensorBoard (if installed).")
    wandb: bool = _f(False, "Also log to Weights & Biases (if installed).")
    dist_timeout_s: int = _f(300, "Collective timeout: a dead rank makes the others fail after this long.", min=1)
    max_bad_steps: int = _f(3, "Stop after this many consecutive steps with a non-finite loss or gradient.", min=1)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Device for the engines (auto: cuda when available).")


@dataclass
class ServerConfig:
    enabled: bool = _f(False, "Start the /v1 control-plane HTTP server on rank 0.")
    host: str = _f("127.0.0.1", "Bind address (non-loopback needs a token).")
    port: int = _f(0, "Port (0: any free port; the URL is written to the run directory).", min=0, max=65535)
    token: Optional[str] = _f(None, "Bearer token for mutating routes (or VERL_DS_SERVER_TOKEN).")
    max_body_bytes: int = _f(65536, "Largest accepted request body.", min=1)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- loading


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}"
                              + (_suggest(value, choices) if isinstance(value, str) else ""))
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected a bool (true/false), got {value!r} ({type(value).__name__})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an int, got {value!r} ({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a float, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r} ({type(value).__name__})")
        return value
    if tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r} ({type(value).__name__})")
        return value
    return value


def _check_range(key: str, value: Any, meta: dict) -> None:
    if value is None or isinstance(value, (bool, str, list)):
        return
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{key}: must be >= {meta['min']}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{key}: must be <= {meta['max']}, got {value!r}")
    if "gt" in meta and not value > meta["gt"]:
        raise ConfigError(f"{key}: must be > {meta['gt']}, got {value!r}")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in by_name:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}{_suggest(str(key), by_name)} "
                              f"(valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(by_name)})")
        f = by_name[key]
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{prefix}{key}.")
        else:
            value = _coerce(prefix + key, value, tp)
            _check_range(prefix + key, value, f.metadata)
            kwargs[key] = value
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'actor.lr=1e-4'`` -> ``('actor.lr', 0.0001)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return key, value


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; ML configs mean a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_load(text):
    return yaml.load(text, Loader=_Loader)


def load_config(path: Optional[str] = None, overrides: Optional[list] = None) -> Config:
    """Load a YAML file (optional) and apply ``key.sub=value`` overrides onto the defaults."""
    tree: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path, encoding="utf-8") as fh:
            try:
                tree = _yaml_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path!r}: expected a mapping at the top level, got {type(tree).__name__}")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    return _build(Config, tree, "")


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Derived:
    """Sizes that follow from the config and the world size (never written back into the config)."""
    world_size: int
    prompts_per_rank: int
    mini_batches_per_epoch: int
    mini_batch_per_rank: int
    grad_accum: int


def validate(cfg: Config, world_size: int = 1) -> Derived:
    """Check cross-field rules (batch arithmetic, choices) and derive per-rank sizes."""
    from verl_ds.algos import KL_KINDS  # local: config loading must not need the numerics

    r, a = cfg.rollout, cfg.actor
    if cfg.algo.kl_kind not in KL_KINDS:
        raise ConfigError(f"algo.kl_kind: expected one of {', '.join(KL_KINDS)}, got {cfg.algo.kl_kind!r}"
                          + _suggest(cfg.algo.kl_kind, KL_KINDS))
    if cfg.algo.clip_ratio_c is not None and cfg.algo.clip_ratio_c <= 1.0:
        raise ConfigError(f"algo.clip_ratio_c: must be > 1 (or null to disable dual clip), got {cfg.algo.clip_ratio_c}")
    if r.batch_size % world_size:
        raise ConfigError(f"rollout.batch_size={r.batch_size} must be divisible by the world size {world_size}")
    if r.batch_size % a.mini_batch_size:
        raise ConfigError(f"actor.mini_batch_size={a.mini_batch_size} must divide rollout.batch_size={r.batch_size}")
    if a.mini_batch_size % world_size:
        raise ConfigError(f"actor.mini_batch_size={a.mini_batch_size} must be divisible by the world size {world_size}")
    per_rank = a.mini_batch_size // world_size
    if per_rank % a.micro_batch_size:
        raise ConfigError(f"actor.micro_batch_size={a.micro_batch_size} must divide the per-rank mini-batch "
                          f"actor.mini_batch_size/world_size = {a.mini_batch_size}/{world_size} = {per_rank}")
    if cfg.deepspeed.offload_param and cfg.deepspeed.zero_stage != 3:
        raise ConfigError(f"deepspeed.offload_param needs deepspeed.zero_stage=3, got {cfg.deepspeed.zero_stage}")
    if cfg.model.path is None:
        if cfg.model.hidden_size % cfg.model.num_heads:
            raise ConfigError(f"model.hidden_size={cfg.model.hidden_size} must be divisible by model.num_heads={cfg.model.num_heads}")
        if cfg.model.num_heads % cfg.model.num_kv_heads:
            raise ConfigError(f"model.num_heads={cfg.model.num_heads} must be divisible by model.num_kv_heads={cfg.model.num_kv_heads}")
        if cfg.data.max_prompt_length + r.max_new_tokens > cfg.model.max_position_embeddings:
            raise ConfigError(f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length + r.max_new_tokens} "
                              f"exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}")
    if not cfg.reward.functions and cfg.reward.model_path is None:
        raise ConfigError("reward: configure at least one of reward.functions or reward.model_path")
    for i, spec in enumerate(cfg.reward.functions):
        if isinstance(spec, dict):
            unknown = set(spec) - {"name", "weight", "per_token"}
            if "name" not in spec or unknown:
                raise ConfigError(f"reward.functions[{i}]: expected a name or {{name, weight, per_token}}, got {spec!r}")
        elif not isinstance(spec, str):
            raise ConfigError(f"reward.functions[{i}]: expected a string or a mapping, got {spec!r}")
    if cfg.trainer.resume not in ("auto", "none") and not os.path.isdir(cfg.trainer.resume):
        raise ConfigError(f"trainer.resume: expected 'auto', 'none' or an existing checkpoint directory, got {cfg.trainer.resume!r}")
    _check_state_ranges(cfg)
    if cfg.deepspeed.config_file is not None and not os.path.isfile(cfg.deepspeed.config_file):
        raise ConfigError(f"deepspeed.config_file: {cfg.deepspeed.config_file!r} does not exist")
    return Derived(world_size=world_size, prompts_per_rank=r.batch_size // world_size,
                   mini_batches_per_epoch=r.batch_size // a.mini_batch_size, mini_batch_per_rank=per_rank,
                   grad_accum=per_rank // a.micro_batch_size)


# SharedState key -> the config key that sets its value at step 0
STATE_FROM_CONFIG = {
    "actor_lr": "actor.lr", "critic_lr": "critic.lr", "kl_coef": "algo.kl_coef", "target_kl": "algo.target_kl",
    "kl_ctrl_type": "algo.kl_ctrl", "kl_kind": "algo.kl_kind", "clip_ratio_low": "algo.clip_ratio_low",
    "clip_ratio_high": "algo.clip_ratio_high", "cliprange_value": "critic.cliprange_value",
    "entropy_coef": "algo.entropy_coef", "gamma": "algo.gamma", "lam": "algo.lam", "temperature": "rollout.temperature",
    "top_k": "rollout.top_k", "top_p": "rollout.top_p", "max_new_tokens": "rollout.max_new_tokens",
}


def initial_state(cfg: Config) -> dict:
    """SharedState values at step 0, taken from the config."""
    out = {}
    for key, dotted in STATE_FROM_CONFIG.items():
        section, name = dotted.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    out["use_kl_penalty"] = cfg.algo.kl_coef > 0 or cfg.algo.kl_ctrl != "fixed"
    return out


def _check_state_ranges(cfg: Config) -> None:
    """The config's initial hyper-parameters must be values SharedState accepts (same ranges as hot updates)."""
    from verl_ds.state import STATE_KEYS

    for key, value in initial_state(cfg).items():
        _, reason = STATE_KEYS[key].check(value)
        if reason is not None:
            raise ConfigError(f"{STATE_FROM_CONFIG.get(key, key)}: {reason} (the SharedState key {key!r} allows "
                              f"{STATE_KEYS[key].range_text() or STATE_KEYS[key].choices})")


def describe() -> str:
    """Markdown table of every key with its type, default and help (docs/config.md is generated from it)."""
    lines = ["| key | type | default | help |", "|---|---|---|---|"]
    hints = typing.get_type_hints(Config)
    for sec in fields(Config):
        cls = hints[sec.name]
        sub_hints = typing.get_type_hints(cls)
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{sec.name}.{f.name}` | {_type_name(sub_hints[f.name])} | `{json.dumps(default)}` | {f.metadata.get('help', '')} |")
    return "\n".join(lines)
