"""Rollout: sampling ignores a checkpoint's generation_config, lengths include EOS, padding after it."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from verl_ds.rollout import Rollout
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer


class _Engine:  # the two attributes Rollout reads from a DeepSpeed engine
    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")


def _model(tok):
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_checkpoint_generation_config_does_not_truncate_sampling():
    tok = build_tokenizer(parity.VOCAB)
    model = _model(tok)
    model.generation_config.top_k = 1  # greedy in disguise: would make every row identical
    model.generation_config.repetition_penalty = 10.0
    enc = tok(["even : 1 2 =>"] * 16, return_tensors="pt", padding=True)
    torch.manual_seed(1)
    gen = Rollout(_Engine(model), tok, gather_params=False).generate(
        enc["input_ids"], enc["attention_mask"].bool(), max_new_tokens=6)
    assert len({tuple(r) for r in gen.responses.tolist()}) > 1


def test_lengths_include_eos_and_padding_follows_it_even_when_pad_is_eos():
    tok = build_tokenizer(parity.VOCAB, pad_is_eos=True)
    assert tok.pad_token_id == tok.eos_token_id
    model = _model(tok)
    enc = tok(["odd : 3 =>", "even : 2 4 6 8 =>"] * 16, return_tensors="pt", padding=True)
    torch.manual_seed(3)
    gen = Rollout(_Engine(model), tok, gather_params=False).generate(
        enc["input_ids"], enc["attention_mask"].bool(), max_new_tokens=12)
    assert gen.responses.shape == (32, 12)
    done = gen.done.tolist()
    assert any(done) and not all(done)  # both kinds of row are checked below
    for row, n, d in zip(gen.responses.tolist(), gen.response_length.tolist(), done):
        if d:  # the EOS itself is part of the response (mask from lengths, never from token != pad)
            assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1]
            assert all(t == tok.pad_token_id for t in row[n:])
        else:
            assert n == 12 and tok.eos_token_id not in row
