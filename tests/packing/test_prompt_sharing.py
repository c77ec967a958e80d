"""Shared prompts (verl_ds.prompt_sharing): the layout by hand, and log-probs, entropies and gradients equal to
every sequence run alone (float64 reference) on tiny Llama and Qwen2 models, with groups of several samples,
a prompt seen once, 1-token and empty responses, left- and right-padded prompts, sliding windows, with and without
the fused LM head, through verl_ds_varlen_sdpa and (forward only: torch has no CPU backward for it) FlexAttention,
fp32 and bf16; the padded path's micro-batch sizes never change the result."""
import pytest
import torch

from packing_testutil import per_sequence_reference, tiny_lm
from verl_ds.models import PolicyModel
from verl_ds.models.packed_forward import packed_logprobs
from verl_ds.attention_layout import LAYOUT_KWARG
from verl_ds.models.varlen_attention import FLEX_ATTENTION, VARLEN_ATTENTION, use_attention, use_varlen_attention
from verl_ds.packing import pack
from verl_ds.prompt_sharing import pack_shared_prompts

T_SAMPLE = 0.7


def grouped_batch(prompts, responses, P, R, side="left"):
    """(observation (B, P + R), mask): the given prompt and response token lists, prompts padded on ``side``."""
    B = len(responses)
    obs = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        cols = range(P - len(p), P) if side == "left" else range(len(p))
        for c, t in zip(cols, p):
            obs[b, c], mask[b, c] = t, True
        for j, t in enumerate(r):
            obs[b, P + j], mask[b, P + j] = t, True
    return obs, mask


def test_layout_by_hand():
    a, b = [5, 6, 7], [8, 9]
    obs, mask = grouped_batch([a, b, a, a], [[10, 11], [12], [13, 14, 15], []], P=3, R=3)
    p = pack_shared_prompts(obs, mask, 3)
    # prompt a once, then the responses of rows 0, 2, 3 (row 3's is empty), then prompt b and row 1's response,
    # each response without its last token (an output there would predict nothing)
    assert p.input_ids.tolist() == [[5, 6, 7, 10, 13, 14, 8, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]
    assert p.groups == ((0, 3, (1, 2, 0)), (6, 2, (0,)))
    assert p.layout.trees == ((0, 6, 3), (6, 8, 1))  # a tree per group: prompt a + two responses, prompt b alone
    assert p.layout.dense(0, 8).int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],  # prompt a, causal
                                          [1, 1, 0, 0, 0, 0, 0, 0],
                                          [1, 1, 1, 0, 0, 0, 0, 0],
                                          [1, 1, 1, 1, 0, 0, 0, 0],  # row 0's first token: prompt a and itself
                                          [1, 1, 1, 0, 1, 0, 0, 0],  # row 2's first two: prompt a and their own
                                          [1, 1, 1, 0, 1, 1, 0, 0],
                                          [0, 0, 0, 0, 0, 0, 1, 0],  # prompt b (row 1's one token is a label only)
                                          [0, 0, 0, 0, 0, 0, 1, 1]]
    assert p.targets.label_ids.tolist() == [10, 11, 13, 14, 15, 12]  # every response token is scored
    assert p.targets.preds.tolist() == [2, 3, 2, 4, 5, 7]  # a response's first token is predicted by its prompt's last
    assert p.targets.out.tolist() == [0 * 3 + 0, 0 * 3 + 1, 2 * 3 + 0, 2 * 3 + 1, 2 * 3 + 2, 1 * 3 + 0]
    assert p.num_tokens == 8 < pack(obs, mask, 3).num_tokens == 14 < pack(obs, mask).num_tokens == 17
    assert p.attention_kwargs() == {LAYOUT_KWARG: p.layout}


def test_errors_name_what_is_wrong():
    obs, mask = grouped_batch([[5], [5]], [[6], [7]], P=1, R=1)
    with pytest.raises(ValueError, match=r"response_width \(R\) must be an int with 1 <= R < T=2, got 2"):
        pack_shared_prompts(obs, mask, 2)
    from verl_ds.models.packed_forward import response_index

    three, three_mask = grouped_batch([[5], [5]], [[6], [7, 8]], P=1, R=2)
    with pytest.raises(ValueError, match=r"response_width R=1 differs from the width the prompts were shared with \(2\)"):
        response_index(pack_shared_prompts(three, three_mask, 2), 1)
    mask[:, 0] = False  # no prompt token: nothing predicts the first response token
    with pytest.raises(ValueError, match=r"rows \[0, 1\] have no real token before their response"):
        pack_shared_prompts(obs, mask, 1)


def _batch(side):
    g = torch.Generator().manual_seed(3)
    prompt = [lambda n: torch.randint(3, 151, (n,), generator=g).tolist()][0]
    pa, pb, pc = prompt(6), prompt(2), prompt(4)
    responses = [prompt(n) for n in (5, 1, 3, 5, 2, 4, 1)]
    return grouped_batch([pa, pa, pb, pa, pc, pb, pb], responses, P=6, R=5, side=side)


def every_model_side_head_and_path(test):
    """Parametrize ``test`` over the model (Llama, Qwen2), the prompts' padding side, the fused LM head and the
    attention (verl_ds_varlen_sdpa, verl_ds_varlen_flex)."""
    for name, values in (("kind", ["llama", "qwen2"]), ("side", ["left", "right"]), ("fused", [False, True]),
                         ("attn", [VARLEN_ATTENTION, FLEX_ATTENTION])):
        test = pytest.mark.parametrize(name, values)(test)
    return test


def check_against_each_sequence(lm, obs, mask, R: int, fused: bool, attn: str = VARLEN_ATTENTION, **pack_kw):
    """Pack (obs, mask) with shared prompts (``pack_kw`` to ``pack_shared_prompts``) and assert that the log-probs,
    entropies and gradients of a weighted sum of both equal each sequence run alone (float64) under attention
    ``attn`` (FlexAttention: log-probs and entropies only, no CPU backward); returns the packing."""
    rmask = mask[:, -R:]
    w_lp, w_ent = torch.randn(obs.shape[0], R), torch.randn(obs.shape[0], R)
    ref_lp, ref_ent, _ = per_sequence_reference(lm, None, obs, mask, R, T_SAMPLE)
    lm.zero_grad()
    ((ref_lp * w_lp + ref_ent * w_ent) * rmask).sum().backward()
    want = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    use_attention(lm, attn)
    shared = pack_shared_prompts(obs, mask, R, **pack_kw)
    lm.zero_grad()
    with torch.set_grad_enabled(attn != FLEX_ATTENTION):
        lp, ent = packed_logprobs(lm, shared, R, T_SAMPLE, compute_entropy=True, fused_lm_head=fused)
    for name, got, ref in (("log-probs", lp, ref_lp), ("entropy", ent, ref_ent)):
        torch.testing.assert_close(got.double() * rmask, ref.detach() * rmask, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
        assert bool((got[~rmask] == 0).all()), name
    if attn == FLEX_ATTENTION:
        return shared
    ((lp * w_lp + ent * w_ent) * rmask).sum().backward()
    got = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    return shared


@every_model_side_head_and_path
def test_shared_prompts_equal_each_sequence_alone(kind, side, fused, attn):
    lm = tiny_lm(kind, seed=1)
    obs, mask = _batch(side)
    shared = check_against_each_sequence(lm, obs, mask, 5, fused, attn)
    assert shared.num_tokens == 12 + 21 - 7  # prompts of 6, 2 and 4 tokens once, 21 response tokens but 7 last ones


@pytest.mark.parametrize("attn", [VARLEN_ATTENTION, FLEX_ATTENTION])
@torch.no_grad()
def test_a_group_without_response_tokens_attends_its_prompt_only(attn):
    lm = use_attention(tiny_lm("llama", seed=4), attn)
    obs, mask = grouped_batch([[5, 6], [5, 6], [7, 8, 9]], [[], [], [10, 11]], P=3, R=2)
    shared = pack_shared_prompts(obs, mask, 2)
    assert shared.groups == ((0, 2, (0, 0)), (2, 3, (1,)))
    lp, _ = packed_logprobs(lm, shared, 2)
    ref, _, _ = per_sequence_reference(lm, None, obs, mask, 2, 1.0)
    torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-5, rtol=1e-5)


def test_policy_model_switch_gives_the_unshared_numbers():
    lm = use_varlen_attention(tiny_lm("llama", seed=2))
    obs, mask = _batch("left")
    R = 5
    plain = PolicyModel(lm, remove_padding=True).get_logprob(obs, obs[:, -R:], mask, T_SAMPLE)
    shared_model = PolicyModel(lm, remove_padding=True, share_prompts=True)
    shared = shared_model.get_logprob(obs, obs[:, -R:], mask, T_SAMPLE)
    rmask = mask[:, -R:]
    torch.testing.assert_close(shared * rmask, plain * rmask, atol=1e-5, rtol=1e-5)
    assert not PolicyModel(lm, share_prompts=True).shares_prompts  # a packed-row layout: needs remove_padding


@pytest.mark.parametrize("attn", [VARLEN_ATTENTION, FLEX_ATTENTION])
@pytest.mark.parametrize("prefixes", [False, True])
def test_sliding_window_layers_keep_each_sequences_window(attn, prefixes):
    """A window shorter than the sequences, counted in each sequence's own positions: shared prompts and prefixes
    equal each sequence alone, and the window matters (a full-attention model gives other numbers)."""
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                  layer_types=["sliding_attention", "full_attention"])
    lm = tiny_lm("qwen2", seed=0, **window)
    obs, mask = grouped_batch([[5, 6, 7, 8], [5, 6, 7, 8], [9], [5, 6, 7, 8]],
                              [[10, 11, 12, 13, 14], [10, 11, 15], [16, 17, 18, 19], [20]], P=4, R=5)
    shared = check_against_each_sequence(lm, obs, mask, 5, False, attn, share_prefixes=prefixes)
    with torch.no_grad():
        full, _ = packed_logprobs(use_attention(tiny_lm("qwen2", seed=0), attn), shared, 5)
        windowed, _ = packed_logprobs(lm, shared, 5)
    assert (full - windowed).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["plain", "shared", "prefixes"])
@torch.no_grad()
def test_flex_in_bf16_follows_each_sequence_alone(layout):
    """FlexAttention in bf16 against each sequence run alone through sdpa in bf16 (looser tolerance: two bf16
    computations in another order), with a 1-token sequence and a sliding window."""
    window = dict(use_sliding_window=True, sliding_window=3, max_window_layers=0,
                  layer_types=["sliding_attention", "full_attention"])
    lm = tiny_lm("qwen2", seed=6, **window).to(torch.bfloat16)
    obs, mask = grouped_batch([[5, 6, 7], [5, 6, 7], [8], [9, 4]], [[10, 11, 12, 13], [10, 11, 14], [15], [16, 17]],
                              P=3, R=4)
    want, _, _ = per_sequence_reference(lm, None, obs, mask, 4, 1.0)
    packed = pack(obs, mask, 4) if layout == "plain" else pack_shared_prompts(obs, mask, 4,
                                                                                share_prefixes=layout == "prefixes")
    assert 1 in [e - s for s, e, _ in packed.layout.trees]  # prompt [8] with a label-only response: one token
    got, _ = packed_logprobs(use_attention(lm, FLEX_ATTENTION), packed, 4)
    rmask = mask[:, -4:]
    # bf16 differs from the float64 reference by ~1e-3 here; ignoring the window would move it by 3e-2
    torch.testing.assert_close(got.double() * rmask, want * rmask, atol=5e-3, rtol=0)


def test_groups_are_attended_tree_by_tree():
    """verl_ds_varlen_sdpa makes one sdpa call per group (a tree: its prompt and responses), with the layout's mask
    on the group's grid (short responses: the grid's masked part is little arithmetic); a group of one sequence is
    sdpa's causal call without a mask."""
    from torch.profiler import ProfilerActivity, profile

    lm = use_varlen_attention(tiny_lm("llama", seed=5))
    obs, mask = grouped_batch([[5, 6], [5, 6], [7, 8, 9], [4]], [[10, 11, 12], [13, 14], [15, 16], [17, 18, 19, 20]],
                              P=3, R=4)
    shared = pack_shared_prompts(obs, mask, 4)
    # group sizes: 2 + (2 + 1) = 5, 3 + 1 = 4, 1 + 3 = 4
    assert [(s, e) for s, e, _ in shared.layout.trees] == [(0, 5), (5, 9), (9, 13)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lp, _ = packed_logprobs(lm, shared, 4)
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    assert calls == 3 * lm.config.num_hidden_layers
    ref, _, _ = per_sequence_reference(lm, None, obs, mask, 4, 1.0)
    rmask = mask[:, -4:]
    torch.testing.assert_close(lp.double() * rmask, ref.detach() * rmask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,window", [("llama", None), ("qwen2", None), ("qwen2", 4)])
@pytest.mark.parametrize("prefixes", [False, True])
def test_long_responses_to_a_short_prompt_attend_branch_by_branch(kind, window, prefixes):
    """Where a tree's (L, L) grid is mostly masked (a 2-token prompt, four 10-12-token responses: the regime of long,
    diverse responses), verl_ds_varlen_sdpa attends the prompt alone and then its responses in one batched call,
    each on its own path: 2 sdpa calls for that tree per layer, and still each sequence alone (log-probs, entropies,
    gradients), with shared response prefixes (a deeper tree) and a sliding window too."""
    from torch.profiler import ProfilerActivity, profile

    cfg = {} if window is None else dict(use_sliding_window=True, sliding_window=window, max_window_layers=0,
                                         layer_types=["sliding_attention", "full_attention"])
    lm = tiny_lm(kind, seed=2, **cfg)
    g = torch.Generator().manual_seed(5)
    tokens = [lambda n: torch.randint(3, 151, (n,), generator=g).tolist()][0]
    pa, pb = tokens(2), tokens(3)
    r0 = tokens(12)
    responses = [r0, r0[:3] + tokens(8), tokens(11), tokens(10), tokens(4)]  # r0 and r1 share 3 leading tokens
    obs, mask = grouped_batch([pa, pa, pa, pa, pb], responses, P=3, R=12)
    shared = check_against_each_sequence(lm, obs, mask, 12, False, share_prefixes=prefixes)
    # the plan saves more than 0.6 x L x hidden (= 32) of the grid's L^2 entries (L = 42 tokens, 39 with prefixes)
    def plan(i):
        start, end, _ = shared.layout.trees[i]
        return shared.layout.branches(i, window, min_saved=0.6 * (end - start) * lm.config.hidden_size)

    assert len(shared.layout.trees) == 2 and plan(0) is not None
    assert plan(1) is None  # prompt b with its one response: 36 entries on the grid, 27 on the plan
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        packed_logprobs(lm, shared, 12)
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    assert calls == (2 + 1) * lm.config.num_hidden_layers
