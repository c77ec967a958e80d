"""Shared prefill in the HF rollout engine: the n samples of a prompt reuse one prefill of it, and their first tokens
are drawn from its logits. The reference is HF generate's own prefill and first step on every row
(share_prefill=False), on float64 models so any difference is ours."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from verl_ds.generation import HFRolloutEngine, shared_prefill
from verl_ds.generation import shared_generation_refusal
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

TOK = build_tokenizer(parity.VOCAB)


def _model(kind: str):
    common = dict(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=TOK.pad_token_id,
                  eos_token_id=TOK.eos_token_id)
    cfg = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a spread next-token distribution: sampling differences would show
    assert shared_generation_refusal(model) is None  # decided once per model, here: its probe forwards are not counted
    return model


def _batch(groups):
    """Left-padded rows: each (prompt, count) pair repeated count times in a row."""
    texts = [text for text, count in groups for _ in range(count)]
    enc = TOK(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


GROUPS = [("odd : 3 =>", 3), ("even : 2 4 6 8 =>", 4), ("odd : 1 =>", 1), ("odd : 3 =>", 2)]


def _generate(model, ids, mask, share, seed, max_new_tokens=7, share_decode=True, **kw):
    engine = HFRolloutEngine(model, pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id,
                             gather_params=False, share_prefill=share, share_decode=share_decode)
    torch.manual_seed(seed)
    return engine.generate(ids, mask, max_new_tokens=max_new_tokens, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("sampling", ["greedy", "temperature", "top_k_top_p", "one_token"])
@pytest.mark.parametrize("share_decode", [True, False])
def test_shared_prefill_draws_the_same_tokens_with_the_same_log_probs(kind, sampling, share_decode):
    model = _model(kind)
    ids, mask = _batch(GROUPS)
    greedy = sampling == "greedy"
    kw = {"greedy": True} if greedy else {"temperature": 0.8}
    if sampling == "top_k_top_p":  # HF's warpers on the first token too, in HF's order
        kw.update(top_k=6, top_p=0.7)
    if sampling == "one_token":  # the first token alone: generate is not called at all
        kw["max_new_tokens"] = 1
    plain, shared = (_generate(model, ids, mask, share, seed=11, share_decode=share_decode, **kw)
                     for share in (False, True))
    assert torch.equal(plain.responses, shared.responses)
    assert torch.equal(plain.response_length, shared.response_length)
    torch.testing.assert_close(shared.log_probs, plain.log_probs, atol=1e-10, rtol=0)
    torch.testing.assert_close(shared.entropy, plain.entropy, atol=1e-10, rtol=0)
    if not greedy:  # the samples of a group differ: the cache copies are independent
        assert len({tuple(r) for r in shared.responses[3:7].tolist()}) > 1
    if not greedy:  # both paths drew the same random numbers: they leave the generator in the same state
        after_shared = torch.rand(4)
        _generate(model, ids, mask, False, seed=11, **kw)
        assert torch.equal(torch.rand(4), after_shared)


def _forwards(model, fn) -> list:
    """The (rows, tokens) of every forward of ``model`` while ``fn()`` runs."""
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    try:
        fn()
    finally:
        hook.remove()
    return calls


def test_the_prompt_runs_once_per_group():
    """Tokens through the model: the prefill takes each distinct prompt once, whole (wherever its rows are), and
    generate's first step then takes each row's first sampled token (instead of every row's whole prompt): one
    forward as many as generate alone makes, with n - 1 of every n prompts left out."""
    model = _model("llama")
    ids, mask = _batch(GROUPS)
    shared_calls = _forwards(model, lambda: _generate(model, ids, mask, True, seed=0, greedy=True, share_decode=False))
    calls = _forwards(model, lambda: _generate(model, ids, mask, False, seed=0, greedy=True))
    width = ids.shape[1]
    assert shared_calls[0] == (3, width)  # 3 distinct prompts (the last group repeats the first prompt)
    assert shared_calls[1:] == [(10, 1)] * 6  # tokens 1..6 of 7 (the 7th is sampled, never fed)
    assert calls == [(10, width)] + [(10, 1)] * 6


@pytest.mark.parametrize("sampling", ["greedy", "temperature"])
def test_shared_decoding_runs_one_row_per_distinct_state(sampling):
    """With share_decode each decoding step feeds one row per distinct (prompt run, tokens so far) among the rows
    that have not ended, counted here from the responses themselves: greedily, each run of equal prompts is one
    row until it ends; sampled, the rows of a run split as their tokens differ."""
    model = _model("llama")
    ids, mask = _batch(GROUPS)
    kw = {"greedy": True} if sampling == "greedy" else {"temperature": 1.5}
    out = []
    calls = _forwards(model, lambda: out.append(_generate(model, ids, mask, True, seed=3, **kw)))
    gen = out[0]
    run = [text for text, count in GROUPS for _ in range(count)]  # each row's prompt
    want = []
    for t in range(1, 7):  # the step that feeds token t - 1 and draws token t
        live = [b for b in range(len(run)) if TOK.eos_token_id not in gen.responses[b, :t].tolist()]
        if not live:
            break
        want.append((len({(run[b], tuple(gen.responses[b, :t].tolist())) for b in live}), 1))
    assert calls[0] == (3, ids.shape[1]) and calls[1:] == want
    if sampling == "temperature":
        assert max(rows for rows, _ in want) > 4  # some runs split: their rows then draw independently
        assert sum(rows for rows, _ in want) < 10 * len(want)  # and some rows still share a state


def test_nothing_to_share_adds_no_forward():
    model = _model("llama")
    ids, mask = _batch([("odd : 3 =>", 1), ("even : 2 4 =>", 1), ("odd : 1 =>", 1)])
    assert shared_prefill(model, ids, mask) is None
    assert shared_prefill(model, ids[:1], mask[:1]) is None
    one = shared_prefill(model, ids[:, -1:], mask[:, -1:])  # equal one-token prompts ("=>") are shared too
    assert one is not None and one.logits.shape == (3, len(TOK)) and one.logits.dtype == torch.float32


def test_equal_prompts_apart_in_the_batch_are_prefilled_once():
    """Rows 0 and 2 hold the same prompt (``verl_ds.rows.prompt_groups``, the shared packing's rule): one prefill row
    for both, and each gets the logits HF's own forward gives its prompt."""
    model = _model("llama")
    ids, mask = _batch([("odd : 3 =>", 1), ("even : 2 4 =>", 1), ("odd : 3 =>", 1)])
    pre = []
    calls = _forwards(model, lambda: pre.append(shared_prefill(model, ids, mask)))
    assert calls == [(2, ids.shape[1])]
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask.long(),
                     position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    torch.testing.assert_close(pre[0].logits, want.float(), atol=1e-6, rtol=0)


def test_rows_with_equal_tokens_but_other_masks_are_not_merged():
    """pad == a real token id: the masks tell the rows apart, so each gets its own prefill."""
    model = _model("llama")
    ids, mask = _batch([("odd : 3 =>", 2)])
    mask = mask.clone()
    mask[1, 0] = ~mask[1, 0]  # same ids, another mask
    assert shared_prefill(model, ids, mask) is None
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    try:
        shared_prefill(model, torch.cat([ids, ids[1:]]), torch.cat([mask, mask[1:]]))
    finally:
        hook.remove()
    assert calls == [(2, ids.shape[1])]  # rows 1 and 2 merged, row 0 apart
