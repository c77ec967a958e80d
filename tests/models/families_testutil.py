"""Every causal-LM family the installed transformers ships, built tiny (2 layers, hidden 32, vocab 256) from its
config class's defaults (a plain module: conftest.py names clash across folders)."""
import inspect

import torch

VOCAB = 256
# config attribute -> tiny value, applied to a family's config and to each of its sub-configs where the attribute
# exists (names differ by family: GPT-2's n_embd, BLOOM's n_layer, DeepSeek's kv_lora_rank, ...)
TINY = {
    "vocab_size": VOCAB, "hidden_size": 32, "d_model": 32, "n_embd": 32, "n_embed": 32, "embed_dim": 32,
    "hidden_dim": 32, "dim": 32, "model_dim": 32, "word_embed_proj_dim": 32,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "multi_query_group_num": 2, "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8, "rotary_dim": 4,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "d_ff": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64,
    "ffn_hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "max_position_embeddings": 128, "n_positions": 128, "max_seq_len": 128, "seq_length": 128,
    "sliding_window": 64, "attention_chunk_size": 64,
    "mamba_d_state": 8, "mamba_d_head": 8, "mamba_n_heads": 8, "mamba_d_conv": 4, "mamba_expand": 2,
    "ssm_state_size": 8, "state_size": 8, "conv_kernel": 4, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_global_experts": 4,
    "image_size": 16, "patch_size": 4, "num_channels": 3, "vision_feature_layer": -1,
}
# families whose defaults need more than TINY to be consistent (or to show their kind of layers at 2 layers)
FAMILY = {
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_chunk_size": 4},
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # a short-convolution layer and an attention layer
    "mamba2": {"head_dim": 16, "num_heads": 4, "n_groups": 1, "chunk_size": 4},
    # per-layer token embeddings of their own vocabulary, and KV sharing from the last layers
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "per_layer_config": {}},
    "gemma3n_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "intermediate_size": 64,
                     "num_kv_shared_layers": 0, "activation_sparsity_pattern": [0.0, 0.0],
                     "layer_types": ["sliding_attention", "full_attention"]},
    "zamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "layers_block_type": None},
    "zamba2": {"hybrid_layer_ids": [1], "layers_block_type": None},
    "dots1": {"max_window_layers": 2},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
}
# multi-head latent attention (DeepSeek-V2/V3 and its kin): a key/value head per query head, and value heads narrower
# than the query/key heads (qk_nope + qk_rope = 16), as in DeepSeek-V2 (192 and 128)
for _mla in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "axk1", "axk2", "sarvam_mla", "glm4_moe_lite",
             "minicpm3", "youtu"):
    FAMILY[_mla] = {"num_key_value_heads": 4, "v_head_dim": 8}
MAX_PARAMS = 3_000_000  # a family whose "tiny" build is larger has sizes TINY does not know: skipped as untestable


def _tiny_kwargs(cls, defaults: dict) -> dict:
    names = set(inspect.signature(cls.__init__).parameters) | set(defaults)
    kw = {k: v for k, v in TINY.items() if k in names}
    for key, value in defaults.items():  # sub-configs (text_config, vision_config, ...) tiny too
        sub = getattr(cls, "sub_configs", {}).get(key)
        if sub is not None and isinstance(value, dict):
            kw[key] = {**value, **_tiny_kwargs(sub, value), **FAMILY.get(getattr(sub, "model_type", ""), {})}
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
            kw[key] = VOCAB - 1 - (hash(key) % 8)
        elif key == "layer_types" or key.endswith("_pattern") or key == "layers_block_type":
            kw[key] = None if value is None or isinstance(value, (list, tuple)) and len(value) > 2 else value
    return kw


def tiny_family_config(model_type: str, **overrides):
    """The family's config with TINY sizes (pad/bos/eos ids inside the vocabulary), then ``overrides``."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kw = _tiny_kwargs(cls, defaults)
    kw = {k: v for k, v in kw.items() if v is not None or k in defaults}
    kw.update(FAMILY.get(model_type, {}))
    kw.update(overrides)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        kw[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[k]
    cfg = cls(**kw)
    return cfg


def tiny_family_lm(model_type: str, seed: int = 0, **overrides):
    """(model in float32, eval mode, sdpa attention, or eager where the family has no sdpa) of the family's causal-LM
    class, from its tiny config; RuntimeError when the tiny build is not tiny."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_family_config(model_type, **overrides)
    try:
        lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    except ValueError as exc:  # no sdpa (e.g. Gemma2's logit softcapping): eager is its reference then
        if "attention implementation" not in str(exc):
            raise
        lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    n = sum(p.numel() for p in lm.parameters())
    if n > MAX_PARAMS:
        raise RuntimeError(f"{n} parameters with the tiny sizes (over {MAX_PARAMS})")
    return lm.float().eval()
