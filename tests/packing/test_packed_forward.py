"""Packed forwards (verl_ds.models.packed_forward) equal every sequence run alone and the padded path: response
log-probs, entropies and critic values, forward and gradients, on tiny Llama and Qwen2 models, with left- and
right-padded prompts, 1-token responses and rows of very different lengths; through transformers' own
packed-row mask (sdpa), through verl_ds_varlen_sdpa and (forward only: no CPU backward in torch) through
verl_ds_varlen_flex, with and without the fused LM head."""
import pytest
import torch

from packing_testutil import padded_batch, per_sequence_reference, tiny_critic, tiny_lm
from verl_ds.models import PolicyModel, ValueModel
from verl_ds.models.packed_forward import (lm_head_returns_logprobs, packed_logprobs, packed_values,
                                           response_index)
from verl_ds.attention_layout import LAYOUT_KWARG
from verl_ds.models.varlen_attention import FLEX_ATTENTION, VARLEN_ATTENTION, use_attention, use_varlen_attention
from verl_ds.packing import pack

T_SAMPLE = 0.7
BATCHES = {  # name: (prompt lengths, response lengths, P, R, prompt side)
    "left_padded_prompts": ([8, 1, 5, 3], [10, 1, 6, 2], 8, 10, "left"),
    "right_padded_prompts": ([8, 1, 5, 3], [10, 1, 6, 2], 8, 10, "right"),
    "one_token_responses": ([6, 2, 4], [1, 1, 1], 6, 1, "left"),
}


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _backward(module, loss):
    module.zero_grad()
    loss.backward()
    return _grads(module)


def _check(name, got, want, rmask):
    torch.testing.assert_close(got.double() * rmask, want.detach().double() * rmask, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{name}: {m}")
    assert bool((got[~rmask] == 0).all()), name  # zeros at padded response positions


def _check_grads(name, got, want):
    assert got.keys() == want.keys(), name
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name} {n}: {m}")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_equals_each_sequence_alone_forward_and_backward(kind):
    lm, critic = tiny_lm(kind, seed=1), tiny_critic(kind, seed=2)
    for name, (pl, rl, P, R, side) in BATCHES.items():
        obs, mask = padded_batch(pl, rl, P, R, side, seed=len(name))
        rmask = mask[:, -R:]
        w_lp, w_ent, w_v = (torch.randn(obs.shape[0], R) for _ in range(3))
        ref_lp, ref_ent, ref_v = per_sequence_reference(lm, critic, obs, mask, R, T_SAMPLE)
        ref_g = _backward(lm, ((ref_lp * w_lp + ref_ent * w_ent) * rmask).sum())
        ref_gc = _backward(critic, (ref_v * w_v * rmask).sum())
        p = pack(obs, mask)
        # transformers' own packed-row mask (sdpa), then verl_ds_varlen_sdpa; the logits path and the fused head
        for attn in ("sdpa", VARLEN_ATTENTION, FLEX_ATTENTION):
            if attn != "sdpa":
                use_attention(lm, attn), use_attention(critic, attn)
            grad = attn != FLEX_ATTENTION  # FlexAttention has no backward on a CPU
            with torch.set_grad_enabled(grad):
                v = packed_values(critic, p, R)
            assert v.shape == (obs.shape[0], R) and v.dtype == torch.float32
            _check(f"{name} {attn} values", v, ref_v, rmask)
            if grad:
                _check_grads(f"{name} {attn} critic", _backward(critic, (v * w_v * rmask).sum()), ref_gc)
            for fused in (False, True):
                case = f"{name} {attn} fused={fused}"
                with torch.set_grad_enabled(grad):
                    lp, ent = packed_logprobs(lm, p, R, T_SAMPLE, compute_entropy=True, fused_lm_head=fused)
                assert lp.shape == ent.shape == (obs.shape[0], R) and lp.dtype == torch.float32
                _check(case, lp, ref_lp, rmask)
                _check(case, ent, ref_ent, rmask)
                if grad:
                    _check_grads(case, _backward(lm, ((lp * w_lp + ent * w_ent) * rmask).sum()), ref_g)
        lm.set_attn_implementation("sdpa"), critic.backbone.set_attn_implementation("sdpa")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_equals_the_padded_path(kind):
    lm, critic = tiny_lm(kind, seed=3), tiny_critic(kind, seed=4)
    use_varlen_attention(lm), use_varlen_attention(critic)  # padded batches keep sdpa's numbers
    for name in ("left_padded_prompts", "one_token_responses"):
        pl, rl, P, R, side = BATCHES[name]
        obs, mask = padded_batch(pl, rl, P, R, side, seed=5)
        rmask = mask[:, -R:]
        with torch.no_grad():
            want_lp, want_ent = PolicyModel(lm).get_logprob(obs, obs[:, -R:], mask, T_SAMPLE, return_entropy=True)
            want_v = ValueModel(critic).get_values(obs, mask, R)
            p = pack(obs, mask)
            lp, ent = packed_logprobs(lm, p, R, T_SAMPLE, compute_entropy=True)
            v = packed_values(critic, p, R)
        for got, want in ((lp, want_lp), (ent, want_ent), (v, want_v)):
            torch.testing.assert_close(got * rmask, want * rmask, atol=1e-5, rtol=1e-5)


def test_sliding_window_layers_keep_their_window_in_packed_rows():
    lm = tiny_lm("qwen2", seed=5, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    obs, mask = padded_batch([6, 2, 4], [5, 1, 3], 6, 5, "left", seed=6)
    ref_lp, ref_ent, _ = per_sequence_reference(lm, None, obs, mask, 5, 1.0)
    for attn in ("sdpa", VARLEN_ATTENTION, FLEX_ATTENTION):
        lm.set_attn_implementation(attn) if attn == "sdpa" else use_attention(lm, attn)
        with torch.set_grad_enabled(attn != FLEX_ATTENTION):
            lp, ent = packed_logprobs(lm, pack(obs, mask), 5, compute_entropy=True)
        torch.testing.assert_close(lp.double() * mask[:, -5:], ref_lp.detach() * mask[:, -5:], atol=1e-5, rtol=1e-5)
    # the window matters here: without it the long rows' log-probs differ
    full = tiny_lm("qwen2", seed=5)
    lp_full, _ = packed_logprobs(full, pack(obs, mask), 5)
    assert (lp_full - lp).abs().max() > 1e-3


def test_tied_embeddings_through_the_fused_head():
    lm = tiny_lm("llama", seed=6, tie_word_embeddings=True)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    obs, mask = padded_batch([4, 2], [3, 5], 4, 5, "left", seed=7)
    p = pack(obs, mask)
    grads = []
    for fused in (False, True):
        lp, ent = packed_logprobs(lm, p, 5, compute_entropy=True, fused_lm_head=fused)
        grads.append(_backward(lm, (lp - 0.3 * ent).sum()))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_attention_kwargs_are_built_once_per_micro_batch():
    """flash-attention's varlen kwargs come from the packing: cu_seq_lens int32 on the row's device, max lengths as
    Python ints, and every call (every layer, every forward of the micro-batch) gets the same objects."""
    obs, mask = padded_batch([3, 1, 2], [2, 1, 2], 3, 2, "left")
    p = pack(obs, mask)
    kw = p.attention_kwargs()
    assert kw["cu_seq_lens_q"] is kw["cu_seq_lens_k"] is p.cu_seqlens
    assert kw["cu_seq_lens_q"].dtype == torch.int32 and kw["cu_seq_lens_q"].device == p.input_ids.device
    assert kw["cu_seq_lens_q"].tolist() == [0, 5, 7, 11]
    assert type(kw["max_length_q"]) is int and kw["max_length_q"] == kw["max_length_k"] == 5
    again = p.attention_kwargs()
    assert all(again[k] is kw[k] for k in kw) and kw[LAYOUT_KWARG].starts == (0, 5, 7, 11)
    seg, _, _ = kw[LAYOUT_KWARG].tensors
    assert kw[LAYOUT_KWARG].tensors[0] is seg  # the layout's tensors too: built on first use, then kept


def test_a_packed_row_without_the_layout_is_split_by_its_position_ids():
    """A caller that passes only position ids (transformers' packed-row convention) gets its sequences kept apart
    by transformers' rule (a new sequence where a position is not the previous plus 1)."""
    lm = tiny_lm("llama", seed=8)
    obs, mask = padded_batch([3, 1, 2], [2, 1, 2], 3, 2, "left", seed=3)
    p = pack(obs, mask)
    bounds = p.cu_seqlens.tolist()
    with torch.no_grad():
        want = torch.cat([lm(input_ids=p.input_ids[:, s:e]).logits for s, e in zip(bounds[:-1], bounds[1:])], 1)
        got = use_varlen_attention(lm)(input_ids=p.input_ids, position_ids=p.position_ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named():
    lm = tiny_lm("llama")
    obs, mask = padded_batch([3, 2], [2, 2], 3, 2, "left")
    p = pack(obs, mask)
    with pytest.raises(ValueError, match=r"response_width \(R\) must be an int with 1 <= R < T=5, got 5"):
        packed_logprobs(lm, p, 5)
    with pytest.raises(ValueError, match="temperature must be a float > 0"):
        packed_logprobs(lm, p, 2, temperature=0)
    no_prompt = mask.clone()
    no_prompt[1, :3] = False
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token before their response"):
        response_index(pack(obs, no_prompt), 2)
    lm.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="transforms its logits .final_logit_softcapping=30.0."):
        packed_logprobs(lm, p, 2, fused_lm_head=True)
    with pytest.raises(TypeError, match="has no output-embedding Linear"):
        with lm_head_returns_logprobs(tiny_critic("llama"), torch.zeros(1, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"per-token values of shape \(1, N\) = \(1, 9\)"):
        packed_values(lambda **kw: torch.zeros(1, 9, 2), p, 2)
    with pytest.raises(TypeError, match="is not a transformers model"):
        use_varlen_attention(torch.nn.Linear(2, 2))
