"""Build the tokenizer, the HF models and their DeepSpeed engines (actor, critic, reference, a reward model); under
ZeRO-3 every model is created already partitioned (``weights.zero3``), even while loading ``model.path``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
from typing import Callable, Optional, Sequence

import torch

from verl_ds.config import Config, ConfigError, Derived
from verl_ds.config.model_fields import tiny_model_fields
from verl_ds.engines.ds_config import make_ds_config, uses_gpu
from verl_ds.weights.lora import LORA_SEED_OFFSET, apply_lora, check_fused_head, lora_spec
from verl_ds.weights.zero3 import (copy_param, copy_params, full_shape, has_partitioned_params,
                                   partitioned_construction, release_free_memory)

log = logging.getLogger(__name__)


def load_tokenizer(cfg: Config):
    """The configured tokenizer (local path), the built-in task's, or the word-level one; pad set, left padding."""
    from transformers import AutoTokenizer

    from verl_ds.tasks import builtin_task
    from verl_ds.tokenizer import build_tokenizer

    path = cfg.model.tokenizer_path or cfg.model.path
    if path is None:
        task = builtin_task(cfg)
        tok = task.tokenizer() if task is not None else build_tokenizer()
    else:
        if not os.path.isdir(path):
            raise ConfigError(f"model.tokenizer_path/model.path: {path!r} is not a directory")
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # the HF message is long; ours names the path
            raise ConfigError(f"no usable tokenizer in {path!r} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                              "point model.tokenizer_path at a directory with tokenizer files") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {path or 'the built-in task'} has no EOS token; responses could never end")
    if cfg.model.path is not None and not getattr(tok, "generation_stop_ids", None):
        from verl_ds.agent.chat_tokens import generation_stop_ids

        # the checkpoint's other stop ids (Llama 3.1: <|eom_id|>, ...): an agent's turns end on them too
        tok.generation_stop_ids = generation_stop_ids(cfg.model.path, tok)
    if tok.pad_token_id is None:
        # pad == eos is then handled by building response masks from lengths, never from token != pad
        tok.pad_token = tok.eos_token
        log.warning("tokenizer has no pad token: using the EOS token %r as pad", tok.eos_token)
    tok.padding_side = "left"
    return tok


def _tiny_lm_config(cfg: Config, tok):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[cfg.model.arch]
    fields = {"tie_word_embeddings": False, "attention_dropout": 0.0, **tiny_model_fields(cfg)}
    return cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, **fields)


def _dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % 2**63


@torch.no_grad()
def init_tiny_weights(model: torch.nn.Module, seed: int, std: float, prefix: str = "") -> None:
    """HF's Llama/Qwen2 init (N(0, std) weights, zero biases and padding row), each parameter from its own (seed,
    ``prefix`` + name) generator: the same on any rank, stage or world size (prefix "model.": a critic's backbone)."""
    for module_name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        for name, param in module.named_parameters(recurse=False):
            full_name = prefix + (f"{module_name}.{name}" if module_name else name)
            if name == "weight":
                gen = torch.Generator().manual_seed(_param_seed(seed, full_name))
                value = torch.empty(tuple(full_shape(param)), dtype=torch.float32).normal_(0.0, std, generator=gen)
                pad = getattr(module, "padding_idx", None)
                if pad is not None:
                    value[pad] = 0.0
            else:
                value = torch.zeros(tuple(full_shape(param)))
            copy_param(value, param)  # every rank computed it whole: this rank keeps its slice


def build_actor_model(cfg: Config, tok, seed_offset: int = 0, *, ds_config: Optional[dict] = None):
    """The actor (or reference) HF causal LM, created partitioned under a ZeRO-3 ``ds_config`` (every rank calls it)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), partitioned_construction(ds_config):
        torch.manual_seed(cfg.model.init_seed + seed_offset)
        if cfg.model.path is None:
            config = _tiny_lm_config(cfg, tok)
            model = AutoModelForCausalLM.from_config(config)
            init_tiny_weights(model, cfg.model.init_seed + seed_offset, config.initializer_range)
        else:
            if not os.path.isdir(cfg.model.path):
                raise ConfigError(f"model.path: {cfg.model.path!r} does not exist or is not a directory")
            model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=_dtype(cfg))
    check_vocab(model, tok, "actor")
    disable_dropout(model)
    return model if has_partitioned_params(model) else model.to(_dtype(cfg))


def build_critic_model(cfg: Config, tok, actor_model=None, *, ds_config: Optional[dict] = None):
    """The backbone plus a scalar value head; a tiny critic's backbone is copied from ``actor_model`` shard by shard."""
    from verl_ds.models.value import VALUE_HEAD_FILE, CriticLM

    path = cfg.model.critic_path or cfg.model.path
    with torch.random.fork_rng(devices=[]), partitioned_construction(ds_config):
        torch.manual_seed(cfg.model.init_seed + 1)
        if path is None:
            config = _tiny_lm_config(cfg, tok)
            critic = CriticLM.from_causal_lm_config(config)
            init_tiny_weights(critic.backbone, cfg.model.init_seed, config.initializer_range, prefix="model.")
        else:
            if not os.path.isdir(path):
                raise ConfigError(f"model.critic_path: {path!r} does not exist or is not a directory")
            critic = CriticLM.from_pretrained(path, torch_dtype=_dtype(cfg))
    if path is None or not os.path.isfile(os.path.join(path, VALUE_HEAD_FILE)):
        # a new head from its own generator (CriticLM's scale): the same on every rank and construction path
        hidden = critic.value_head.in_features
        gen = torch.Generator().manual_seed(_param_seed(cfg.model.init_seed + 1, "value_head.weight"))
        with torch.no_grad():
            critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=gen)
                                           * (0.02 / math.sqrt(hidden)))
            critic.value_head.bias.zero_()
    critic.value_head.to(_dtype(cfg))
    if path is None and actor_model is not None:
        copy_backbone(actor_model, critic)
    check_vocab(critic.backbone, tok, "critic")  # a critic_path from another model family: a silent index error
    disable_dropout(critic)
    return critic if has_partitioned_params(critic) else critic.to(_dtype(cfg))


def copy_backbone(actor_model, critic) -> None:
    """Start the critic's backbone from the actor's (the usual PPO initialisation); shard by shard under ZeRO-3."""
    src = actor_model.get_decoder() if hasattr(actor_model, "get_decoder") else actor_model.model
    copy_params(src, critic.backbone)


def check_vocab(model, tok, role: str) -> None:
    """The tokenizer must not produce ids beyond the model's embedding table (a silent index error on GPU)."""
    n_embed = full_shape(model.get_input_embeddings().weight)[0]
    if len(tok) > n_embed:
        raise ConfigError(f"{role}: the tokenizer has {len(tok)} tokens but the model's embedding has {n_embed} rows; "
                          "use the tokenizer that belongs to the model (or resize the embeddings before training)")


def disable_dropout(model) -> None:
    """No dropout anywhere: PPO's ratio assumes the rollout and the update see the same function. eval() is not
    enough (the engines run in train mode), and HF attention keeps its own float rate besides nn.Dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if _is_dropout_rate(key, value):
                setattr(module, key, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if _is_dropout_rate(key, value):
                setattr(config, key, 0.0)


def _is_dropout_rate(key: str, value) -> bool:
    return ("dropout" in key or "pdrop" in key) and isinstance(value, float)


def _torch_adamw(params, lr, weight_decay):
    params = list(params)
    # torch's fused AdamW (CPU and CUDA since torch 2.4) updates every tensor in one kernel where the CPU default
    # loops over the tensors, several ops each; it needs floating tensors on one device type
    kinds = {(p.device.type, p.dtype.is_floating_point) for p in params}
    fused = True if kinds in ({("cpu", True)}, {("cuda", True)}) else None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8, fused=fused)


def _deepspeed_cpu_adam(params, lr, weight_decay):
    # the compiled AVX Adam over pinned CPU memory: what ZeRO-Offload is designed around (Ren et al. 2021)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8, adamw_mode=True)


# name -> factory(params, lr, weight_decay); ``optimizer_name`` picks one per run
OPTIMIZERS = {"torch_adamw": _torch_adamw, "deepspeed_cpu_adam": _deepspeed_cpu_adam}


def optimizer_name(cfg: Config) -> str:
    """DeepSpeed's CPU Adam when the optimizer is offloaded from a GPU, else torch AdamW (no compiled op needed)."""
    offloaded = cfg.deepspeed.offload_optimizer and cfg.deepspeed.zero_stage > 0
    return "deepspeed_cpu_adam" if offloaded and uses_gpu(cfg) else "torch_adamw"


def make_engine(model, cfg: Config, derived: Derived, role: str, lr: float = 0.0, weight_decay: float = 0.0,
                grad_clip: float = 0.0):
    """Wrap ``model`` in a DeepSpeed engine; trainable roles get the optimizer ``optimizer_name(cfg)`` names."""
    import deepspeed

    ds_cfg = make_ds_config(cfg, derived, role, grad_clip=grad_clip, gpu=uses_gpu(cfg))
    if role in ("actor", "critic"):
        if cfg.model.gradient_checkpointing:
            target = model.backbone if hasattr(model, "backbone") else model
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # frozen parameters (a LoRA base) get no optimizer state
        optimizer = OPTIMIZERS[optimizer_name(cfg)]([p for p in model.parameters() if p.requires_grad], lr,
                                                    weight_decay)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
        engine.train()
        skip_lone_rank_allreduce(engine)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
        engine.eval()
    return engine


def skip_lone_rank_allreduce(engine) -> bool:
    """Turn off (DeepSpeed's own switch) a lone ZeRO-0 rank's gradient all-reduce, which flattens and copies back
    every gradient for an identity; returns whether it did. Stages 1-3 reduce in their ZeRO optimizer."""
    if engine.zero_optimization_stage() != 0 or engine.dp_world_size != 1 or not engine.enable_backward_allreduce:
        return False
    engine.enable_backward_allreduce = False
    return True


def build_engines(cfg: Config, derived: Derived, tok, roles: Sequence[str] = ("actor", "ref", "critic"),
                  sft_warmup: Optional[Callable] = None) -> dict:
    """The DeepSpeed engines of ``roles`` (a subset of actor, ref, critic); every rank must call this. The reference
    and a tiny critic's backbone are copied from the actor shard by shard; ``sft_warmup(engine)`` first trains a
    temporary actor engine (no gradient accumulation: one ``backward``/``step`` per step) whose weights every role
    starts from. LoRA wraps the actor / the critic's backbone last; a LoRA actor gets no reference."""
    unknown = sorted(set(roles) - {"actor", "ref", "critic"})
    if unknown:
        raise ValueError(f"build_engines: unknown roles {unknown}; expected a subset of ('actor', 'ref', 'critic')")
    actor_lora, critic_lora = lora_spec(cfg, "actor"), lora_spec(cfg, "critic")
    if actor_lora is not None and "ref" in roles:
        raise ValueError("build_engines: with actor.lora_rank > 0 no reference engine is built (the reference is "
                         "the actor with its adapters off: verl_ds.weights.lora.adapters_off)")
    ds = {role: make_ds_config(cfg, derived, role, gpu=uses_gpu(cfg)) for role in ("actor", "ref", "critic")}
    need_actor = "actor" in roles or sft_warmup is not None
    actor_model = build_actor_model(cfg, tok, ds_config=ds["actor"]) if need_actor else None
    release_free_memory()  # each stage starts without the previous one's freed buffers still resident
    sft_engine = None
    if sft_warmup is not None:
        sft_engine = make_engine(actor_model, cfg, dataclasses.replace(derived, grad_accum=1), "actor",
                                 lr=cfg.actor.lr, weight_decay=0.01)
        with torch.random.fork_rng(devices=[]):
            sft_warmup(sft_engine)
        sft_engine.eval()
        actor_model = build_actor_model(cfg, tok, ds_config=ds["actor"]) if "actor" in roles else None
        source = sft_engine.module
        if actor_model is not None:
            copy_params(source, actor_model)
    else:
        source = actor_model
    models = {}
    if "ref" in roles:
        models["ref"] = build_actor_model(cfg, tok, ds_config=ds["ref"])
        if source is not None:  # the initial policy exactly, whatever the stages and the init path
            copy_params(source, models["ref"])
        release_free_memory()
    if "critic" in roles:
        models["critic"] = build_critic_model(cfg, tok, actor_model=source, ds_config=ds["critic"])
        release_free_memory()
    if sft_engine is not None:
        sft_engine.destroy()
        del sft_engine, source
    if actor_model is not None and actor_lora is not None:  # adapters on the (warmed-up) actor; its base is frozen
        actor_model = apply_lora(actor_model, actor_lora, seed=cfg.model.init_seed + LORA_SEED_OFFSET["actor"])
        if cfg.model.fused_lm_head:
            check_fused_head(actor_model)
    if "critic" in models and critic_lora is not None:  # the backbone gets adapters, the value head trains whole
        models["critic"].backbone = apply_lora(models["critic"].backbone, critic_lora, task_type=None,
                                               seed=cfg.model.init_seed + LORA_SEED_OFFSET["critic"])
    engines = {}
    if actor_model is not None:
        a = cfg.actor
        engines["actor"] = make_engine(actor_model, cfg, derived, "actor", lr=a.lr, weight_decay=a.weight_decay,
                                       grad_clip=a.grad_clip)
        release_free_memory()
    if "critic" in models:
        c = cfg.critic
        engines["critic"] = make_engine(models["critic"], cfg, derived, "critic", lr=c.lr, weight_decay=c.weight_decay,
                                        grad_clip=c.grad_clip)
        release_free_memory()
    if "ref" in models:
        engines["ref"] = make_engine(models["ref"], cfg, derived, "ref")
        release_free_memory()
    return {role: engines[role] for role in roles}


def build_reward_engine(cfg: Config, derived: Derived, model_path: str):
    """A frozen engine around a HF sequence classifier (one label), partitioned like the reference."""
    from transformers import AutoModelForSequenceClassification

    if not os.path.isdir(model_path):
        raise ConfigError(f"reward model path {model_path!r} does not exist or is not a directory")
    with partitioned_construction(make_ds_config(cfg, derived, "ref", gpu=uses_gpu(cfg))):
        model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    disable_dropout(model)
    return make_engine(model, cfg, derived, "ref")
