"""Shared response prefixes (``pack_shared_prompts(..., share_prefixes=True)``, ``model.share_response_prefixes``):
the samples of a prompt also share the leading response tokens they have in common. The layout by hand, and
log-probs, entropies and gradients equal to every sequence run alone (float64 reference) on tiny Llama and Qwen2
models: identical responses, a response that is a prefix of another, branches at several depths, empty and 1-token
responses, with and without the fused LM head, through verl_ds_varlen_sdpa and FlexAttention (forward only)."""
import pytest
import torch

from packing_testutil import tiny_lm
from test_prompt_sharing import check_against_each_sequence, every_model_side_head_and_path, grouped_batch
from verl_ds.models import PolicyModel
from verl_ds.models.varlen_attention import use_varlen_attention
from verl_ds.prompt_sharing import pack_shared_prompts

T_SAMPLE = 0.7


def test_layout_by_hand():
    a, b = [5, 6, 7], [8, 9]
    obs, mask = grouped_batch([a, b, a, a, a], [[10, 11, 12], [16, 17], [10, 14], [10, 11, 13], [15]], P=3, R=3)
    p = pack_shared_prompts(obs, mask, 3, share_prefixes=True)
    # group a's rows in the order of their fed tokens (each response without its last): row 4 (none), row 2 (10),
    # row 0 (10 11), row 3 (10 11, all shared): the 10 once, the 11 once
    assert p.input_ids.tolist() == [[5, 6, 7, 10, 11, 8, 9, 16]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    # row 0 continues row 2's depth-0 token (the group's 2nd response); row 3 holds nothing of its own
    assert p.groups == ((0, 3, (0, 1, 1, 0), ((), (), (2,), (2, 3))), (5, 2, (1,)))
    # segments: prompt a, the shared 10 (cut: row 0 continues it), row 0's 11, prompt b, row 1's 16
    assert (p.layout.starts, p.layout.parents, p.layout.first_pos) == ((0, 3, 4, 5, 7, 8), (-1, 0, 1, -1, 3),
                                                                       (0, 3, 4, 0, 2))
    assert p.layout.dense(0, 8).int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],  # prompt a
                                          [1, 1, 0, 0, 0, 0, 0, 0],
                                          [1, 1, 1, 0, 0, 0, 0, 0],
                                          [1, 1, 1, 1, 0, 0, 0, 0],  # the shared 10: prompt a and itself
                                          [1, 1, 1, 1, 1, 0, 0, 0],  # the 11 (row 2's 10, then its own)
                                          [0, 0, 0, 0, 0, 1, 0, 0],  # prompt b
                                          [0, 0, 0, 0, 0, 1, 1, 0],
                                          [0, 0, 0, 0, 0, 1, 1, 1]]  # row 1's 16
    t = p.targets
    # 11 response tokens to score (out places), 8 distinct (predictor, token) pairs
    places = sorted(zip(t.out.tolist(), (t.preds[t.take].tolist()), t.label_ids[t.take].tolist()))
    assert places == [(0, 2, 10), (1, 3, 11), (2, 4, 12),  # row 0: 10 after the prompt, 11 after 10, 12 after 11
                      (3, 6, 16), (4, 7, 17),  # row 1
                      (6, 2, 10), (7, 3, 14),  # row 2
                      (9, 2, 10), (10, 3, 11), (11, 4, 13),  # row 3: the same predictors as row 0
                      (12, 2, 15)]  # row 4
    assert sorted(zip(t.preds.tolist(), t.label_ids.tolist())) == [(2, 10), (2, 15), (3, 11), (3, 14), (4, 12),
                                                                   (4, 13), (6, 16), (7, 17)]


def test_without_a_shared_prefix_the_layout_is_the_prompt_sharing_one():
    a = [5, 6]
    obs, mask = grouped_batch([a, a, a], [[10, 11], [12, 13, 14], [15]], P=2, R=3)
    shared = pack_shared_prompts(obs, mask, 3, share_prefixes=True)
    assert shared.groups == ((0, 2, (0, 1, 2)),)  # rows by their responses (15 | 10 | 12 13), no links
    assert shared.targets.take is None and shared.num_tokens == pack_shared_prompts(obs, mask, 3).num_tokens


def test_responses_that_do_not_start_at_the_response_columns_are_not_compared():
    obs, mask = grouped_batch([[5], [5]], [[10, 11], [10, 11]], P=1, R=3)
    obs[:, 1:] = obs[:, 1:].roll(1, 1)  # each response one column later: a gap after the prompt
    mask[:, 1:] = mask[:, 1:].roll(1, 1)
    shared = pack_shared_prompts(obs, mask, 3, share_prefixes=True)
    assert shared.num_tokens == 3 and shared.targets.take is None  # the prompt and each response's fed token


def _prefix_batch(side):
    """Three prompts; group a's responses share prefixes at several depths (one equals another, one is another's
    prefix), group b's share only their first token, c is alone; an empty and a 1-token response."""
    g = torch.Generator().manual_seed(7)
    tok = [lambda n: torch.randint(3, 151, (n,), generator=g).tolist()][0]
    pa, pb, pc = tok(5), tok(2), tok(3)
    x, y, u = tok(4), tok(3), tok(2)
    responses = {0: x + u, 1: x + u, 2: x[:2] + tok(3), 3: x, 4: x[:3],  # group a
                 5: y[:1] + tok(4), 6: y + tok(2), 7: y[:1], 8: [],  # group b
                 9: tok(6)}  # c
    prompts = [pa] * 5 + [pb] * 4 + [pc]
    order = [3, 5, 0, 9, 6, 1, 8, 2, 7, 4]  # groups interleaved in the batch
    return grouped_batch([prompts[i] for i in order], [responses[i] for i in order], P=5, R=6, side=side)


@every_model_side_head_and_path
def test_shared_prefixes_equal_each_sequence_alone(kind, side, fused, attn):
    lm = tiny_lm(kind, seed=2)
    obs, mask = _prefix_batch(side)
    shared = check_against_each_sequence(lm, obs, mask, 6, fused, attn, share_prefixes=True)
    # fed tokens (each response without its last): group a's x + u[:1] twice, x[:2] + 2, x[:3], x[:2]: 7 distinct,
    # not 19; group b's y[:1] + 3 and y + 1 (none for the others): 7, not 8
    assert pack_shared_prompts(obs, mask, 6).num_tokens - shared.num_tokens == (19 - 7) + (8 - 7)
    assert shared.targets.take is not None and shared.targets.take.numel() == int(mask[:, -6:].sum())


def test_policy_model_switch_gives_the_unshared_numbers():
    lm = use_varlen_attention(tiny_lm("llama", seed=3))
    obs, mask = _prefix_batch("left")
    R = 6
    plain = PolicyModel(lm, remove_padding=True).get_logprob(obs, obs[:, -R:], mask, T_SAMPLE)
    model = PolicyModel(lm, remove_padding=True, share_prompts=True, share_prefixes=True)
    assert model.shares_prompts
    rmask = mask[:, -R:]
    torch.testing.assert_close(model.get_logprob(obs, obs[:, -R:], mask, T_SAMPLE) * rmask, plain * rmask,
                               atol=1e-5, rtol=1e-5)
