"""Shared helpers for the Models tests (a plain module: conftest.py names clash across test folders)."""
import torch

PAD, BOS, EOS, VOCAB = 0, 1, 2, 50


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
              max_position_embeddings=64)
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_rollout_batch(B=4, P=5, R=4, seed=0, eos_rows=(0,)):
    """A RolloutBatch with left-padded prompts and random responses; rows in eos_rows end with EOS early."""
    from verl_ds.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    prompt_len[-1] = P
    prompt_mask = torch.arange(P).unsqueeze(0) >= (P - prompt_len).unsqueeze(1)
    prompt_ids = torch.where(prompt_mask, torch.randint(3, VOCAB, (B, P), generator=g), torch.full((B, P), PAD))
    responses = torch.randint(3, VOCAB, (B, R), generator=g)
    for i in eos_rows:
        responses[i, R // 2] = EOS
    return RolloutBatch.from_generation(prompt_ids, prompt_mask, responses, pad_token_id=PAD, eos_token_id=EOS,
                                        extras={"prompt": [f"prompt {i}" for i in range(B)]})
