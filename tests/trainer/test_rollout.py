"""Rollout through the HF engine: a checkpoint's generation_config never changes how we sample, lengths include
EOS, padding follows it, and the sampler's log-probs are the trainer's."""
import math

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from verl_ds.generation import HFRolloutEngine
from verl_ds.models import PolicyModel
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer


def _model(tok, scale: float = 1.0):
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # spread the next-token distribution so temperature matters
    return model


def _engine(model, tok):
    return HFRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, gather_params=False)


def test_checkpoint_generation_config_does_not_change_sampling(tmp_path):
    """transformers 4.50-4.57 replaced generate arguments equal to HF's defaults (temperature 1.0, top_p 1.0) with
    the checkpoint's generation_config.json values; sampling then follows T=0.6, top_p=0.95 while the trainer scores
    T=1. The first token's empirical distribution must be the T=1, untruncated one: a likelihood ratio over 4096
    draws tells the two apart by a wide margin."""
    tok = build_tokenizer(parity.VOCAB)
    model = _model(tok, scale=30.0)
    model.generation_config.temperature, model.generation_config.top_p = 0.6, 0.95
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path)
    assert '"temperature": 0.6' in (tmp_path / "generation_config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    enc = tok(["even : 1 2 =>"] * 4096, return_tensors="pt", padding=True)
    torch.manual_seed(1)
    gen = _engine(loaded, tok).generate(enc["input_ids"], enc["attention_mask"].bool(), max_new_tokens=1,
                                        temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        logits = loaded(input_ids=enc["input_ids"][:1], attention_mask=enc["attention_mask"][:1]).logits[0, -1].double()
    counts = torch.bincount(gen.responses[:, 0], minlength=logits.numel()).double()
    logp_t1, logp_t06 = torch.log_softmax(logits, -1), torch.log_softmax(logits / 0.6, -1)
    probs = logp_t1.exp()
    tail = probs.sort(descending=True).values.cumsum(0) >= 0.95  # tokens a top_p=0.95 sampler could never draw
    assert probs[probs.argsort(descending=True)[tail]].sum() > 0.02  # the case is sharp enough to show
    llr = float((counts * (logp_t1 - logp_t06)).sum())  # > 0: the draws fit T=1 better than T=0.6
    assert llr > 50.0, llr
    # and the log-probs reported with the tokens are those of softmax(logits / 1.0)
    expected = logp_t1[gen.responses[:, 0]].float()
    assert torch.allclose(gen.log_probs[:, 0], expected, atol=1e-5)


def test_lengths_include_eos_and_padding_follows_it_even_when_pad_is_eos():
    tok = build_tokenizer(parity.VOCAB, pad_is_eos=True)
    assert tok.pad_token_id == tok.eos_token_id
    model = _model(tok)
    enc = tok(["odd : 3 =>", "even : 2 4 6 8 =>"] * 16, return_tensors="pt", padding=True)
    torch.manual_seed(3)
    gen = _engine(model, tok).generate(enc["input_ids"], enc["attention_mask"].bool(), max_new_tokens=12)
    assert gen.responses.shape == (32, 12)
    done = gen.done.tolist()
    assert any(done) and not all(done)  # both kinds of row are checked below
    for row, n, d, lp in zip(gen.responses.tolist(), gen.response_length.tolist(), done, gen.log_probs):
        if d:  # the EOS itself is part of the response (mask from lengths, never from token != pad)
            assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1]
            assert all(t == tok.pad_token_id for t in row[n:])
        else:
            assert n == 12 and tok.eos_token_id not in row
        assert bool((lp[:n] < 0).all()) and bool((lp[n:] == 0).all())


def test_sampled_log_probs_match_the_trainers_recomputation():
    """What the sampler reports for each drawn token equals get_logprob's recomputation (temperature 0.7, top-k and
    top-p on): the sampler scores the untruncated softmax(logits / T), as the trainer does."""
    tok = build_tokenizer(parity.VOCAB)
    model = _model(tok, scale=5.0).eval()
    policy = PolicyModel(model, tokenizer=tok)
    enc = tok(["odd : 3 =>", "even : 2 4 6 8 =>"] * 4, return_tensors="pt", padding=True)
    torch.manual_seed(5)
    action, log_probs, entropy = policy.get_action(enc["input_ids"], enc["attention_mask"].bool(), temperature=0.7,
                                                   top_k=5, top_p=0.9, max_new_tokens=6)
    obs = torch.cat([enc["input_ids"], action], 1)
    lengths = torch.tensor([(row.tolist() + [tok.eos_token_id]).index(tok.eos_token_id) + 1 for row in action])
    lengths = lengths.clamp(max=action.shape[1])
    rmask = torch.arange(action.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    mask = torch.cat([enc["attention_mask"].bool(), rmask], 1)
    with torch.no_grad():
        recomputed = policy.get_logprob(obs, action, mask=mask, temperature=0.7)
    assert torch.allclose(log_probs[rmask], recomputed[rmask], atol=1e-5)
    assert bool((entropy[rmask] > 0).all()) and bool((entropy[rmask] <= math.log(len(tok)) + 1e-5).all())
