"""Build the tokenizer, the HF models and their DeepSpeed engines (actor, critic, reference)."""
from __future__ import annotations

import logging
import os

import torch

from verl_ds.config import Config, ConfigError, Derived
from verl_ds.engines.ds_config import make_ds_config

log = logging.getLogger(__name__)


def load_tokenizer(cfg: Config):
    """The configured tokenizer (local path) or the built-in word-level one; pad set and left padding."""
    from transformers import AutoTokenizer

    from verl_ds.tokenizer import build_tokenizer

    path = cfg.model.tokenizer_path or cfg.model.path
    if path is None:
        from verl_ds.tasks import parity

        # the built-in task's own small vocabulary: a fresh model then samples task words, not 280 others
        vocab = parity.VOCAB if cfg.data.train_files is None else None
        tok = build_tokenizer(vocab, pad_is_eos=cfg.model.pad_is_eos)
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
    if tok.pad_token_id is None:
        # pad == eos is then handled by building response masks from lengths, never from token != pad
        tok.pad_token = tok.eos_token
        log.warning("tokenizer has no pad token: using the EOS token %r as pad", tok.eos_token)
    tok.padding_side = "left"
    return tok


def _tiny_lm_config(cfg: Config, tok):
    from transformers import LlamaConfig, Qwen2Config

    m = cfg.model
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[m.arch]
    return cls(vocab_size=len(tok), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
               num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
               max_position_embeddings=m.max_position_embeddings, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
               attention_dropout=0.0)


def _dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32


def build_actor_model(cfg: Config, tok, seed_offset: int = 0):
    """The actor (or reference) HF causal LM: from ``model.path`` or a tiny config, same weights on every rank."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.init_seed + seed_offset)
        if cfg.model.path is None:
            model = AutoModelForCausalLM.from_config(_tiny_lm_config(cfg, tok))
        else:
            if not os.path.isdir(cfg.model.path):
                raise ConfigError(f"model.path: {cfg.model.path!r} does not exist or is not a directory")
            model = AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=_dtype(cfg))
    check_vocab(model, tok, "actor")
    disable_dropout(model)
    return model.to(_dtype(cfg))


def build_critic_model(cfg: Config, tok, actor_model=None):
    """The critic: the LM backbone plus a scalar value head; tiny critics start from the actor's backbone."""
    from verl_ds.models.value import CriticLM

    path = cfg.model.critic_path or cfg.model.path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.init_seed + 1)
        if path is None:
            critic = CriticLM.from_causal_lm_config(_tiny_lm_config(cfg, tok))
            if actor_model is not None:
                copy_backbone(actor_model, critic)
        else:
            if not os.path.isdir(path):
                raise ConfigError(f"model.critic_path: {path!r} does not exist or is not a directory")
            critic = CriticLM.from_pretrained(path, torch_dtype=_dtype(cfg))
    check_vocab(critic.backbone, tok, "critic")  # a critic_path from another model family: a silent index error
    disable_dropout(critic)
    return critic.to(_dtype(cfg))


def copy_backbone(actor_model, critic) -> None:
    """Start the critic's backbone from the actor's (the usual PPO initialisation)."""
    src = actor_model.get_decoder() if hasattr(actor_model, "get_decoder") else actor_model.model
    critic.backbone.load_state_dict(src.state_dict())


def check_vocab(model, tok, role: str) -> None:
    """The tokenizer must not produce ids beyond the model's embedding table (a silent index error on GPU)."""
    n_embed = model.get_input_embeddings().weight.shape[0]
    if len(tok) > n_embed:
        raise ConfigError(f"{role}: the tokenizer has {len(tok)} tokens but the model's embedding has {n_embed} rows; "
                          "use the tokenizer that belongs to the model (or resize the embeddings before training)")


def disable_dropout(model) -> None:
    """PPO's ratio assumes the rollout and the update see the same function: no dropout anywhere.

    The engines run in train mode, so setting eval() is not enough; HF attention layers also keep their
    own float (``self.attention_dropout``, read from the config once at construction) besides nn.Dropout.
    """
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


def make_engine(model, cfg: Config, derived: Derived, role: str, lr: float = 0.0, weight_decay: float = 0.0,
                grad_clip: float = 0.0):
    """Wrap ``model`` in a DeepSpeed engine; trainable roles get a torch AdamW (no JIT-compiled FusedAdam)."""
    import deepspeed

    ds_cfg = make_ds_config(cfg, derived, role, grad_clip=grad_clip)
    if role in ("actor", "critic"):
        if cfg.model.gradient_checkpointing:
            target = model.backbone if hasattr(model, "backbone") else model
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
        engine.train()
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
        engine.eval()
    return engine


def set_lr(engine, lr: float) -> None:
    """Apply a (hot-updated) learning rate to every parameter group."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
