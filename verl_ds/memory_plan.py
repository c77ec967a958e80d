"""Per-rank memory of a run's engines, estimated from the config before anything is launched (``verl-ds plan``):
parameter counts from the config on the ``meta`` device, DeepSpeed's own estimators for the trained engines.
What the plan prints: docs/launch.md, "Before launching"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from verl_ds.config import Config, Derived, sequence_tokens

GiB = 2**30
VLLM_CPU_KV_BYTES = 256 << 20  # VLLMRolloutEngine's KV cache on CPU when rollout.vllm_kv_cache_bytes is null
BUFFER_FACTOR = 1.5  # DeepSpeed's default additional_buffer_factor for CPU memory


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of one model, as DeepSpeed's estimators want them."""
    total: int           # unique parameters (tied embeddings counted once)
    largest_layer: int   # most parameters held directly by one module (what ZeRO-3 gathers at once)
    vocab_size: int
    hidden_size: int
    source: str          # the directory the config came from, or "tiny config"
    num_layers: int = 0  # for the KV cache of generate
    kv_dim: int = 0      # key/value heads x head dim: one layer's K (or V) width per token


@dataclass(frozen=True)
class RoleMemory:
    """Estimated bytes for one engine: per GPU (each rank) and per node's CPU memory."""
    role: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    gpu_bytes: int
    cpu_bytes_per_node: int
    note: str


def _meta_size(config, critic: bool, source: str) -> ModelSize:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        model = (AutoModel if critic else AutoModelForCausalLM).from_config(config)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    if critic:  # CriticLM = AutoModel backbone + Linear(hidden, 1)
        total += hidden + 1
        largest = max(largest, hidden + 1)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return ModelSize(total=total, largest_layer=largest, vocab_size=int(text.vocab_size), hidden_size=hidden,
                     source=source, num_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
                     kv_dim=kv_heads * head_dim)


def model_size(cfg: Config, role: str = "actor") -> ModelSize:
    """Parameter counts of the actor/reference (``role="actor"``/``"ref"``) or the critic, from the config only."""
    if role not in ("actor", "ref", "critic"):
        raise ValueError(f"role: expected 'actor', 'ref' or 'critic', got {role!r}")
    critic = role == "critic"
    path = (cfg.model.critic_path or cfg.model.path) if critic else cfg.model.path
    if path is None:
        from verl_ds.engines.build import _tiny_lm_config, load_tokenizer

        return _meta_size(_tiny_lm_config(cfg, load_tokenizer(cfg)), critic, "tiny config")
    import os

    from transformers import AutoConfig

    key = "model.critic_path" if critic and cfg.model.critic_path else "model.path"
    if not os.path.isdir(path):
        raise ValueError(f"{key}: {path!r} is not a directory (plan reads the model's config.json from it)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # HF's message is long; ours names the key
        raise ValueError(f"{key}: no usable config.json in {path!r} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    return _meta_size(config, critic, path)


def _zero_settings(ds_cfg: dict) -> tuple[int, bool, bool]:
    zero = ds_cfg.get("zero_optimization", {})
    off_opt = str(zero.get("offload_optimizer", {}).get("device", "none")).lower() not in ("none", "")
    off_param = str(zero.get("offload_param", {}).get("device", "none")).lower() not in ("none", "")
    return int(zero.get("stage", 0)), off_opt, off_param


def trained_engine_memory(role: str, size: ModelSize, stage: int, offload_optimizer: bool, offload_param: bool,
                          nodes: int, gpus_per_node: int) -> RoleMemory:
    """Model states of a trained engine by DeepSpeed's estimators; CPU: the steady state, not the build's peak."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = nodes * gpus_per_node
    p = size.total
    if stage == 3:
        # DeepSpeed's estimator has no "params offloaded, optimizer on GPU" row; offloading params implies
        # the optimizer goes too in its model, so that row is the closest (and a lower bound on GPU).
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            p, size.largest_layer, num_gpus_per_node=gpus_per_node, num_nodes=nodes,
            cpu_offload=offload_optimizer or offload_param, cpu_offload_params=offload_param, zero_init=True,
            additional_buffer_factor=BUFFER_FACTOR)
        note = "DeepSpeed estimate_zero3_model_states_mem_needs"
        if offload_param and not offload_optimizer:
            note += "; offload_param without offload_optimizer: GPU is a lower bound"
    elif stage in (1, 2):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            p, num_gpus_per_node=gpus_per_node, num_nodes=nodes, cpu_offload=offload_optimizer,
            additional_buffer_factor=BUFFER_FACTOR)
        note = "DeepSpeed estimate_zero2_model_states_mem_needs"
        if stage == 1 and not offload_optimizer:
            # stage 1 keeps the full 16-bit gradients on every rank; stage 2's figure holds 1/n of them
            gpu += int(2 * p - 2 * p / n)
            note += " + unpartitioned 16-bit gradients (stage 1)"
    else:
        # nothing is partitioned: the stage-2 figure for a single rank
        cpu, gpu = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=1, num_nodes=1, cpu_offload=False,
                                                         additional_buffer_factor=BUFFER_FACTOR)
        cpu = int(p * 4 * gpus_per_node * BUFFER_FACTOR)
        note = "stage 0: DeepSpeed estimate_zero2_model_states_mem_needs for one rank (nothing partitioned)"
    return RoleMemory(role, stage, offload_optimizer, offload_param, int(gpu), int(cpu), note)


def inference_engine_memory(role: str, size: ModelSize, bytes_per_param: int, offload_param: bool,
                            nodes: int, gpus_per_node: int, zero_stage: int = 3) -> RoleMemory:
    """A frozen engine: ZeRO-3 parameters split over the ranks plus one gathered layer, at stage 0 the whole model."""
    if zero_stage < 3:
        return RoleMemory(role, 0, False, False, bytes_per_param * size.total, 0,
                          "inference stage 0: the whole model on every rank")
    n = nodes * gpus_per_node
    layer = bytes_per_param * size.largest_layer
    shard = 0 if offload_param else math.ceil(bytes_per_param * size.total / n)
    offloaded = int(bytes_per_param * size.total / nodes * BUFFER_FACTOR) if offload_param else 0
    return RoleMemory(role, 3, False, offload_param, layer + shard, offloaded,
                      "inference ZeRO-3: parameters / world size + one gathered layer (CPU: offloaded parameters)")


def estimate_memory(cfg: Config, derived: Derived, nodes: int, gpus_per_node: int,
                    sizes: Optional[dict] = None) -> dict:
    """Per-role RoleMemory plus the extras in bytes: rollout replica, KV cache, logits and the start-up peaks."""
    from verl_ds.engines.ds_config import make_ds_config

    sizes = sizes or {"actor": model_size(cfg, "actor"), "critic": model_size(cfg, "critic")}
    bpp = 2 if cfg.model.dtype == "bf16" else 4
    out: dict = {}
    for role in ("actor", "critic"):
        stage, off_opt, off_param = _zero_settings(make_ds_config(cfg, derived, role))
        out[role] = trained_engine_memory(role, sizes[role], stage, off_opt, off_param, nodes, gpus_per_node)
    ref_stage, _, ref_off = _zero_settings(make_ds_config(cfg, derived, "ref"))
    out["ref"] = inference_engine_memory("ref", sizes["actor"], bpp, ref_off, nodes, gpus_per_node, ref_stage)
    actor = sizes["actor"]
    seq = sequence_tokens(cfg)
    out["rollout_replica"] = bpp * actor.total if cfg.rollout.gather_params else 0
    # generate's cache: K and V per layer for every token of this rank's prompts (either generation mode)
    out["kv_cache"] = 2 * actor.num_layers * actor.kv_dim * bpp * derived.prompts_per_rank * seq
    # fp32 log-softmax over the vocabulary of one micro-batch: the usual PPO memory spike (a sequence-parallel rank
    # scores the tokens of its slice of the row)
    per_rank = math.ceil(cfg.actor.micro_batch_size * seq / cfg.model.sequence_parallel_size)
    out["logits"] = 4 * per_rank * actor.vocab_size
    out["activation_tokens"], out["activations"] = activation_memory(cfg, actor)
    whole = out["actor"].zero_stage < 3
    biggest = max(actor.total, sizes["critic"].total)
    out["startup_peak"] = bpp * (biggest if whole else max(actor.largest_layer, sizes["critic"].largest_layer))
    out["steady"] = (out["actor"].gpu_bytes + out["critic"].gpu_bytes + out["ref"].gpu_bytes + out["rollout_replica"]
                     + out["kv_cache"])
    out["cpu_per_node"] = sum(out[r].cpu_bytes_per_node for r in ("actor", "critic", "ref"))
    from_disk = bpp * biggest if cfg.model.path else 0  # rank 0 maps the checkpoint while loading it
    out["cpu_build_peak"] = out["startup_peak"] * gpus_per_node + from_disk
    # what one rank needs at its busiest: states, the replica, and the larger of generate's cache and the logits
    states = out["actor"].gpu_bytes + out["critic"].gpu_bytes + out["ref"].gpu_bytes
    out["need"] = states + out["rollout_replica"] + max(out["kv_cache"], out["logits"])
    # per-token gathering instead: no replica, one gathered layer while generating
    out["need_without_replica"] = states + max(out["kv_cache"] + bpp * actor.largest_layer, out["logits"])
    if cfg.rollout.engine == "vllm":
        _vllm_memory(cfg, actor, out, states, gpus_per_node)
    return out


# saved activations of one transformer layer per token, in bytes at 16 bits, without recomputation and without the
# attention scores (a flash/varlen kernel keeps none): Korthikanti et al. 2022, "Reducing Activation Recomputation in
# Large Transformer Models" (arXiv:2205.05198), section 4.1: 34 * hidden
ACTIVATION_BYTES_PER_HIDDEN = 34


def activation_memory(cfg: Config, actor: ModelSize) -> tuple[int, int]:
    """(tokens, bytes) of one actor micro-batch's saved activations per rank: an order-of-magnitude estimate."""
    a, seq = cfg.actor, sequence_tokens(cfg)
    tokens = math.ceil((a.max_tokens_per_micro_batch or a.micro_batch_size * seq) / cfg.model.sequence_parallel_size)
    scale = (2 if cfg.model.dtype == "bf16" else 4) / 2  # the rule counts 16-bit tensors
    layer = ACTIVATION_BYTES_PER_HIDDEN * actor.hidden_size * scale * tokens
    if cfg.model.gradient_checkpointing:
        return tokens, int(actor.num_layers * 2 * actor.hidden_size * scale * tokens + layer)
    return tokens, int(actor.num_layers * layer)


def _vllm_memory(cfg: Config, actor: ModelSize, out: dict, states: int, gpus_per_node: int) -> None:
    """vLLM's weights and KV cache, held through the updates unless ``rollout.vllm_sleep`` (GPU share: fit_advice)."""
    r = cfg.rollout
    dtype = cfg.model.dtype if r.vllm_dtype == "auto" else r.vllm_dtype
    weights = (4 if dtype == "fp32" else 2) * actor.total
    kv = r.vllm_kv_cache_bytes or (VLLM_CPU_KV_BYTES if cfg.trainer.device == "cpu" else None)
    out["rollout_replica"], out["kv_cache"] = weights, kv or 0
    out["vllm_fraction"] = None if kv is not None else r.vllm_gpu_memory_utilization
    reserved = 0 if kv is None else weights + kv
    out["steady"] = states + reserved
    if r.vllm_sleep:  # asleep during the update: the logits' peak and vLLM's never meet
        out["need"] = states + max(reserved, out["logits"])
        out["cpu_per_node"] += weights * gpus_per_node  # sleep level 1 keeps the weights in CPU memory
    else:
        out["need"] = states + reserved + out["logits"]
    out["need_without_replica"], out["states"] = out["need"], states


def device_memory(cfg: Config, memory_gib: Optional[float] = None) -> Optional[int]:
    """Bytes one rank may use: ``memory_gib`` when given, else the visible GPU's (a CUDA job), else None."""
    if memory_gib is not None:
        if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or not memory_gib > 0:
            raise ValueError(f"memory_gib: expected a positive number of GiB, got {memory_gib!r}")
        return int(memory_gib * GiB)
    if cfg.trainer.device != "cpu":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    return None
