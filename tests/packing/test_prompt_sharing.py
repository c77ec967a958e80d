"""Shared prompts (verl_ds.prompt_sharing): the layout by hand, and log-probs, entropies and gradients equal to
every sequence run alone (float64 reference) on tiny Llama and Qwen2 models, with groups of several samples,
a prompt seen once, 1-token and empty responses, left- and right-padded prompts, with and without the fused LM
head; the padded path's micro-batch sizes never change the result."""
import pytest
import torch

from packing_testutil import per_sequence_reference, tiny_lm
from verl_ds.models import PolicyModel
from verl_ds.models.packed_forward import packed_logprobs
from verl_ds.models.varlen_attention import use_varlen_attention
from verl_ds.packing import pack
from verl_ds.prompt_sharing import PROMPT_GROUPS_KWARG, pack_shared_prompts

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
    assert p.groups.groups == ((0, 3, (1, 2, 0)), (6, 2, (0,)))
    ((start, end, block),) = p.groups.blocks  # both groups fit one block: one attention call
    assert (start, end) == (0, 8)
    assert block[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],  # prompt a, causal
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
    assert p.attention_kwargs() == {PROMPT_GROUPS_KWARG: p.groups}


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


def _force_path(monkeypatch, path) -> list:
    """Attend shared rows by blocks or as one batch of groups, as told; returns the list that each batched attention
    call appends to."""
    import verl_ds.models.varlen_attention as va
    import verl_ds.prompt_sharing as sharing

    monkeypatch.setattr(sharing, "_batch_is_cheaper", lambda groups, blocks: path == "batched" and len(groups) > 1)
    monkeypatch.setattr(va, "BATCH_MIN_SAVED_MACS", -(1 << 62))  # whatever the saving, even none
    calls, batched = [], va._batched_group_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return batched(*args, **kwargs)

    monkeypatch.setattr(va, "_batched_group_attention", spy)
    return calls


def every_model_side_head_and_path(test):
    """Parametrize ``test`` over the model (Llama, Qwen2), the prompts' padding side, the fused LM head and the
    attention path (blocks, batched)."""
    for name, values in (("kind", ["llama", "qwen2"]), ("side", ["left", "right"]), ("fused", [False, True]),
                         ("path", ["blocks", "batched"])):
        test = pytest.mark.parametrize(name, values)(test)
    return test


def check_against_each_sequence(lm, obs, mask, R: int, fused: bool, **pack_kw):
    """Pack (obs, mask) with shared prompts (``pack_kw`` to ``pack_shared_prompts``) and assert that the log-probs,
    entropies and gradients of a weighted sum of both equal each sequence run alone (float64); returns the packing."""
    rmask = mask[:, -R:]
    w_lp, w_ent = torch.randn(obs.shape[0], R), torch.randn(obs.shape[0], R)
    ref_lp, ref_ent, _ = per_sequence_reference(lm, None, obs, mask, R, T_SAMPLE)
    lm.zero_grad()
    ((ref_lp * w_lp + ref_ent * w_ent) * rmask).sum().backward()
    want = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    use_varlen_attention(lm)
    shared = pack_shared_prompts(obs, mask, R, **pack_kw)
    lm.zero_grad()
    lp, ent = packed_logprobs(lm, shared, R, T_SAMPLE, compute_entropy=True, fused_lm_head=fused)
    ((lp * w_lp + ent * w_ent) * rmask).sum().backward()
    for name, got, ref in (("log-probs", lp, ref_lp), ("entropy", ent, ref_ent)):
        torch.testing.assert_close(got.double() * rmask, ref.detach() * rmask, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
        assert bool((got[~rmask] == 0).all()), name
    got = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    return shared


@every_model_side_head_and_path
def test_shared_prompts_equal_each_sequence_alone(kind, side, fused, path, monkeypatch):
    batched_calls = _force_path(monkeypatch, path)
    lm = tiny_lm(kind, seed=1)
    obs, mask = _batch(side)
    shared = check_against_each_sequence(lm, obs, mask, 5, fused)
    assert shared.num_tokens == 12 + 21 - 7  # prompts of 6, 2 and 4 tokens once, 21 response tokens but 7 last ones
    assert (shared.groups.batched is not None) == (path == "batched")
    assert len(batched_calls) == (lm.config.num_hidden_layers if path == "batched" else 0)


@pytest.mark.parametrize("path", ["blocks", "batched"])
def test_a_group_without_response_tokens_attends_its_prompt_only(path, monkeypatch):
    batched_calls = _force_path(monkeypatch, path)
    lm = use_varlen_attention(tiny_lm("llama", seed=4))
    obs, mask = grouped_batch([[5, 6], [5, 6], [7, 8, 9]], [[], [], [10, 11]], P=3, R=2)
    shared = pack_shared_prompts(obs, mask, 2)
    assert shared.groups.groups == ((0, 2, (0, 0)), (2, 3, (1,)))
    lp, _ = packed_logprobs(lm, shared, 2)
    assert bool(batched_calls) == (path == "batched")
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


def test_sliding_window_layers_are_refused():
    lm = use_varlen_attention(tiny_lm("qwen2", seed=0, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=0, layer_types=["sliding_attention"] * 2))
    obs, mask = _batch("left")
    with pytest.raises(ValueError, match=r"shared prompts need full attention; this layer has a sliding window of 4"):
        packed_logprobs(lm, pack_shared_prompts(obs, mask, 5), 5)


def test_groups_over_the_block_cap_are_attended_in_several_blocks(monkeypatch):
    """Blocks hold whole groups up to BLOCK_TOKENS tokens (a longer group alone): with a cap of 6 tokens the three
    groups below take three calls, and the log-probs still equal each sequence alone."""
    import verl_ds.prompt_sharing as sharing

    monkeypatch.setattr(sharing, "BLOCK_TOKENS", 6)
    lm = use_varlen_attention(tiny_lm("llama", seed=5))
    obs, mask = grouped_batch([[5, 6], [5, 6], [7, 8, 9], [4]], [[10, 11, 12], [13, 14], [15, 16], [17, 18, 19, 20]],
                              P=3, R=4)
    shared = pack_shared_prompts(obs, mask, 4)
    # group sizes: 2 + (2 + 1) = 5, 3 + 1 = 4, 1 + 3 = 4: no two fit in 6 tokens
    assert [(s, e) for s, e, _ in shared.groups.blocks] == [(0, 5), (5, 9), (9, 13)]
    lp, _ = packed_logprobs(lm, shared, 4)
    ref, _, _ = per_sequence_reference(lm, None, obs, mask, 4, 1.0)
    rmask = mask[:, -4:]
    torch.testing.assert_close(lp.double() * rmask, ref.detach() * rmask, atol=1e-5, rtol=1e-5)


def test_batched_groups_layout_by_hand():
    """Groups of 4 and 3 tokens padded to 4 slots: the gather index (a pad slot repeats its group's first token),
    the slot of each packed token, and each group's mask with its pad query seeing its first slot only."""
    import verl_ds.prompt_sharing as sharing

    a, b = [5, 6], [8]
    obs, mask = grouped_batch([a, b, a], [[10, 11], [12, 13, 14], [15, 16]], P=2, R=3)
    groups = pack_shared_prompts(obs, mask, 3).groups.groups
    assert groups == ((0, 2, (1, 1)), (4, 1, (2,)))  # [5, 6, 10, 15 | 8, 12, 13]
    batch = sharing._group_batch(list(groups), "cpu")
    assert batch.index.tolist() == [0, 1, 2, 3, 4, 5, 6, 4]
    assert batch.valid.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert batch.mask.shape == (2, 1, 4, 4)
    assert batch.mask[0, 0].int().tolist() == [[1, 0, 0, 0],  # prompt a
                                               [1, 1, 0, 0],
                                               [1, 1, 1, 0],  # row 0's response token: the prompt and itself
                                               [1, 1, 0, 1]]  # row 2's: the prompt and itself, not row 0's
    assert batch.mask[1, 0].int().tolist() == [[1, 0, 0, 0],  # prompt b
                                               [1, 1, 0, 0],  # row 1's response tokens
                                               [1, 1, 1, 0],
                                               [1, 0, 0, 0]]  # the pad slot: its group's first slot only


def test_batch_is_chosen_when_it_scores_fewer_pairs():
    import verl_ds.prompt_sharing as sharing

    # four groups of 35 tokens in one block: 4 x 35^2 = 4900 pairs against 140^2 = 19600
    groups = [(35 * g, 7, (7, 7, 7, 7)) for g in range(4)]
    spans = sharing._block_spans(groups)
    assert spans == ((0, 140),) and sharing._batch_is_cheaper(groups, spans)
    # one long group and three short ones: 4 x 100^2 against 130^2
    uneven = [(0, 40, (30, 30)), (100, 5, (5,)), (110, 5, (5,)), (120, 5, (5,))]
    assert not sharing._batch_is_cheaper(uneven, sharing._block_spans(uneven))
    assert not sharing._batch_is_cheaper(groups[:1], sharing._block_spans(groups[:1]))  # one group: one call anyway
    obs, mask = grouped_batch([[5, 6, 7]] * 2 + [[8, 9, 4]] * 2 + [[3, 2, 1]] * 2,
                              [[10, 11, 12]] * 6, P=3, R=3)
    assert pack_shared_prompts(obs, mask, 3).groups.batched is not None  # 3 x 7^2 < 21^2: the real packer agrees


def test_the_attention_batches_groups_only_when_the_saving_pays_for_the_gathers(monkeypatch):
    """The same layout (4 groups of 35 tokens in one block: 14700 fewer pairs) is attended as a batch at 8 heads of
    64 (7.5M multiply-adds saved per product) and by its block at 4 heads of 16 (0.9M), with BATCH_MIN_SAVED_MACS
    = 2^22."""
    import verl_ds.models.varlen_attention as va
    import verl_ds.prompt_sharing as sharing

    groups = [(35 * g, 7, (7, 7, 7, 7)) for g in range(4)]
    layout = sharing.PromptGroups(groups=tuple(groups))
    assert layout.saved_pairs == 140 ** 2 - 4 * 35 ** 2 and va.BATCH_MIN_SAVED_MACS == 1 << 22
    calls = []

    def batch(module, query, *args, **kwargs):
        calls.append("batch")
        return query.transpose(1, 2)

    def block(module, query, *args, **kwargs):
        calls.append("block")
        return query.transpose(1, 2), None

    monkeypatch.setattr(va, "_batched_group_attention", batch)
    monkeypatch.setattr(va, "_attend", block)
    for heads, dim, want in ((4, 16, "block"), (8, 64, "batch")):
        calls.clear()
        q = torch.zeros(1, heads, 140, dim)
        va._shared_prompt_attention(None, q, q, q, layout, 0.0, None, {})
        assert calls == [want], (heads, dim)
        # each way is built when first used, and only then
        assert ("blocks" in vars(layout)) and (("batched" in vars(layout)) == (want == "batch"))
