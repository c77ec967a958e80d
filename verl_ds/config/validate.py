"""Cross-field rules and derived sizes: what a config means for a given world size, without touching any file
except the DeepSpeed JSON it names. Rules that need the package's registries run when the run is built
(``verl_ds.run.checks``)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .deepspeed import check_deepspeed_file
from .fields import ConfigError, show
from .model_fields import check_config_overrides, tiny_model_fields
from .schema import MAX_REWARD_WEIGHT, Config, hot_fields

# SharedState key -> the config key that sets its value at step 0
STATE_FROM_CONFIG: dict[str, str] = {key: dotted for key, dotted, _, _ in hot_fields()}


@dataclass(frozen=True)
class Derived:
    """Sizes that follow from the config and the world size (never written back into the config).

    Samples are prompts x rollout.n; the n responses of a prompt stay on one rank (a group)."""
    world_size: int
    prompts_per_rank: int
    mini_batches_per_epoch: int
    mini_batch_per_rank: int  # samples per rank per optimizer step
    grad_accum: int  # actor micro-batches per optimizer step
    samples_per_rank: int = 0


def _batch_arithmetic(cfg: Config, world_size: int) -> Derived:
    r, a = cfg.rollout, cfg.actor
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an int >= 1, got {world_size!r}")
    samples = r.batch_size * r.n
    per_step = f"rollout.batch_size * rollout.n = {r.batch_size} * {r.n} = {samples}" if r.n > 1 \
        else f"rollout.batch_size={r.batch_size}"
    if r.batch_size % world_size:
        raise ConfigError(f"rollout.batch_size={r.batch_size} must be divisible by the world size {world_size}")
    if samples % a.mini_batch_size:
        raise ConfigError(f"actor.mini_batch_size={a.mini_batch_size} must divide {per_step}")
    if a.mini_batch_size % world_size:
        raise ConfigError(f"actor.mini_batch_size={a.mini_batch_size} must be divisible by the world size {world_size}")
    per_rank = a.mini_batch_size // world_size
    if per_rank % a.micro_batch_size:
        raise ConfigError(f"actor.micro_batch_size={a.micro_batch_size} must divide the per-rank mini-batch "
                          f"actor.mini_batch_size/world_size = {a.mini_batch_size}/{world_size} = {per_rank}")
    return Derived(world_size=world_size, prompts_per_rank=r.batch_size // world_size,
                   mini_batches_per_epoch=samples // a.mini_batch_size, mini_batch_per_rank=per_rank,
                   grad_accum=per_rank // a.micro_batch_size, samples_per_rank=samples // world_size)


def _check_sequence_parallel(cfg: Config, world_size: int) -> None:
    m, key = cfg.model, "model.sequence_parallel_size"
    sp = m.sequence_parallel_size
    if sp == 1:
        return
    if world_size % sp:
        raise ConfigError(f"{key}={sp} must divide the world size {world_size} (data-parallel groups x "
                          f"sequence-parallel groups = world)")
    if not m.remove_padding:
        raise ConfigError(f"{key}={sp} splits packed rows: it needs model.remove_padding=true")
    f = tiny_model_fields(cfg)
    heads, kv = f["num_attention_heads"], f["num_key_value_heads"]
    if m.path is None and (heads % sp or kv % sp):
        raise ConfigError(f"{key}={sp} must divide num_attention_heads={heads} and num_key_value_heads={kv} (of "
                          f"model.config_overrides): each rank attends heads/{sp} of them")


def _check_kl_controller(cfg: Config) -> None:
    """An adaptive controller multiplies the coefficient: started at 0 it stays 0, while the reference it makes
    the run build scores every step for nothing."""
    kind = cfg.algo.kl_ctrl
    if cfg.algo.kl_coef == 0 and kind != "fixed":
        raise ConfigError(f"algo.kl_coef: 0 with algo.kl_ctrl={kind} would stay 0 for the whole run (the {kind} "
                          f"controller multiplies the coefficient), while a reference model is built and run every "
                          f"step; set algo.kl_coef > 0 as the controller's starting point (e.g. 0.01), or "
                          f"algo.kl_ctrl=fixed to train without a KL term and without a reference")


def _check_reward_functions(cfg: Config) -> None:
    if not cfg.reward.functions and cfg.reward.model_path is None and cfg.distill.teacher_path is None:
        raise ConfigError("reward: configure at least one of reward.functions or reward.model_path (or "
                          "distill.teacher_path: a teacher's per-token reverse KL alone trains the actor)")
    for i, spec in enumerate(cfg.reward.functions):
        where = f"reward.functions[{i}]"
        if isinstance(spec, dict):
            unknown = set(spec) - {"name", "weight", "per_token"}
            if "name" not in spec or unknown:
                raise ConfigError(f"{where}: expected a name or {{name, weight, per_token}}, got {show(spec)}")
            name, weight, per_token = spec["name"], spec.get("weight", 1.0), spec.get("per_token", False)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(float(weight)):
                raise ConfigError(f"{where}.weight: expected a finite number, got {show(weight)}")
            if abs(weight) > MAX_REWARD_WEIGHT:  # finite in float64, but the float32 scores would overflow
                raise ConfigError(f"{where}.weight: {show(weight)} is out of range [-{MAX_REWARD_WEIGHT:g}, "
                                  f"{MAX_REWARD_WEIGHT:g}] (weighted scores are float32)")
            if not isinstance(per_token, bool):
                raise ConfigError(f"{where}.per_token: expected a bool (true/false), got {show(per_token)}")
        else:
            name = spec
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: expected a reward function name (a non-empty string) or a mapping, got {show(spec)}")


def _check_distill(cfg: Config) -> None:
    if cfg.distill.teacher_path == "base" and cfg.actor.lora_rank == 0:
        raise ConfigError("distill.teacher_path=base is the actor's base with its LoRA adapters off: it needs "
                          "actor.lora_rank > 0 (a fully fine-tuned actor has no base apart from itself); set "
                          "actor.lora_rank or point distill.teacher_path at a model directory")


def _check_dpo(cfg: Config) -> None:
    if cfg.dpo.loss == "ipo" and cfg.dpo.label_smoothing:
        raise ConfigError(f"dpo.label_smoothing={cfg.dpo.label_smoothing}: label smoothing applies to the sigmoid loss "
                          "only; set it to 0 with dpo.loss=ipo")


# what every prompt item holds besides pass-through fields (verl_ds.data builds them)
RESERVED_ITEM_KEYS = ("input_ids", "prompt")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    reserved = sorted(set(d.passthrough_keys) & set(RESERVED_ITEM_KEYS))
    if reserved:
        raise ConfigError(f"data.passthrough_keys: {reserved} name the tokenized prompt's own fields "
                          f"{list(RESERVED_ITEM_KEYS)}; expected other field names (rename those fields in the data)")
    if d.train_files is None and cfg.rollout.batch_size > d.num_train_prompts:
        raise ConfigError(f"rollout.batch_size={cfg.rollout.batch_size} is larger than the prompt set "
                          f"(data.num_train_prompts={d.num_train_prompts}): a step draws rollout.batch_size distinct "
                          "prompts; raise data.num_train_prompts or lower rollout.batch_size")


def _check_async(cfg: Config) -> None:
    """rollout.mode one_step_off / streaming generate in a thread beside training (``verl_ds.asyncrl``): nothing it
    runs may be a collective."""
    r = cfg.rollout
    # split one_step_off generates whole batches between weight syncs on ranks of their own: vLLM can serve that;
    # streaming's partial rollouts need the HF engine's per-step hook
    vllm_ok = r.engine == "vllm" and r.split_ranks > 0 and r.mode == "one_step_off"
    why = [(r.engine != "hf" and not vllm_ok, f"rollout.engine={r.engine} (use hf; vllm serves rollout.split_ranks "
                                              f"with rollout.mode=one_step_off)"),
           (not r.gather_params, "rollout.gather_params=false (the thread would gather ZeRO-3 shards)"),
           (cfg.reward.model_path is not None, "reward.model_path (a reward model's forward is a collective)"),
           (cfg.algo.dynamic_sampling, "algo.dynamic_sampling=true (its rounds are agreed over ranks)"),
           (cfg.agent.environment is not None, "agent.environment (multi-turn episodes)")]
    bad = [w for cond, w in why if cond]
    if r.split_ranks and r.mode == "sync":
        raise ConfigError(f"rollout.split_ranks={r.split_ranks} needs rollout.mode=one_step_off or streaming, got "
                          f"{r.mode}")
    if bad:
        raise ConfigError(f"rollout.mode={r.mode} generates in a thread beside training and cannot run with "
                          f"{'; '.join(bad)}; use rollout.mode=sync")


def _check_common(cfg: Config, derived: Derived) -> None:
    """The rules of the keys every job reads (the RL job and the supervised ones): ZeRO offload, the model shape, the
    sequence-parallel degree, the dpo section, the checkpoint to resume, the DeepSpeed JSON."""
    if cfg.deepspeed.offload_param and cfg.deepspeed.zero_stage != 3:
        raise ConfigError(f"deepspeed.offload: param needs deepspeed.zero_stage=3, got {cfg.deepspeed.zero_stage}")
    check_config_overrides(cfg)
    _check_sequence_parallel(cfg, derived.world_size)
    _check_dpo(cfg)
    if cfg.trainer.resume not in ("auto", "none") and not os.path.isdir(cfg.trainer.resume):
        raise ConfigError(f"trainer.resume: expected 'auto', 'none' or an existing checkpoint directory, "
                          f"got {cfg.trainer.resume!r}")
    check_deepspeed_file(cfg, derived)


def validate(cfg: Config, world_size: int = 1) -> Derived:
    """Check the RL job's cross-field rules (batch arithmetic, the KL controller, reward entries, data, async
    rollouts) and those of every job (``_check_common``), and derive per-rank sizes; ConfigError naming the key."""
    if not isinstance(cfg, Config):
        raise TypeError(f"validate expects a Config (from load_config), got {type(cfg).__name__}")
    derived = _batch_arithmetic(cfg, world_size)
    _check_kl_controller(cfg)
    if cfg.agent.environment is None:  # an environment's rules need the agent registry: verl_ds.run.checks
        _check_reward_functions(cfg)
    _check_distill(cfg)
    _check_data(cfg)
    if cfg.rollout.mode != "sync" or cfg.rollout.split_ranks:
        _check_async(cfg)
    _check_common(cfg, derived)
    return derived


def validate_stage(cfg: Config, world_size: int = 1) -> Derived:
    """A supervised job's rules (``verl-ds sft|rm|dpo``): its batch arithmetic (a step is ``actor.mini_batch_size``
    rows, no rollout) and the rules of every job; the sizes the engines need. The RL-only sections are not read."""
    if not isinstance(cfg, Config):
        raise TypeError(f"validate_stage expects a Config (from load_config), got {type(cfg).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an int >= 1, got {world_size!r}")
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
    # one optimizer step per batch of rows: the RL job's sizes with a "rollout" of mini_batch_size rows
    derived = Derived(world_size=world_size, prompts_per_rank=per_rank, mini_batches_per_epoch=1,
                      mini_batch_per_rank=per_rank, grad_accum=per_rank // a.micro_batch_size,
                      samples_per_rank=per_rank)
    _check_common(cfg, derived)
    return derived
