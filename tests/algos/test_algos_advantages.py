"""verl_ds.algos critic-free advantage estimators: float64 loop references, hand cases, edge cases."""
import math

import numpy as np
import pytest
import torch
from algos_refs import (
    grpo_loop,
    reinforce_pp_baseline_loop,
    reinforce_pp_loop,
    remax_loop,
    rloo_loop,
)

from verl_ds.algos import (
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_advantage_estimator,
    masked_whiten,
    register_advantage_estimator,
)

TOL = dict(atol=2e-6, rtol=1e-5)


def _outcome(scores, width=4, lengths=None):
    """Token rewards with each score on the last response token, and the right-padded mask."""
    b = len(scores)
    lengths = lengths or [width] * b
    rewards = torch.zeros(b, width)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = True
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


def _random_batch(b, width, seed, n_groups):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, width, generator=g)
    mask = torch.rand(b, width, generator=g) > 0.3
    mask[0] = False  # a fully masked row
    if b > 2:
        mask[1] = True
    ids = torch.randint(0, n_groups, (b,), generator=g).tolist()
    return rewards, mask, ids


# --- against the float64 loops ---------------------------------------------------------------------

@pytest.mark.parametrize("b,width,n_groups,seed", [(1, 1, 1, 0), (7, 13, 3, 1), (16, 5, 16, 2), (33, 9, 4, 3)])
def test_group_estimators_match_loops(b, width, n_groups, seed):
    rewards, mask, ids = _random_batch(b, width, seed, n_groups)
    for norm in (True, False):
        adv, ret = compute_grpo_advantage(rewards, mask, ids, norm_by_std=norm)
        assert adv.dtype == torch.float32 and adv.shape == (b, width)
        torch.testing.assert_close(adv.double(), grpo_loop(rewards, mask, ids, 1e-6, norm), **TOL)
        torch.testing.assert_close(ret, adv)
    adv, ret = compute_rloo_advantage(rewards, mask, ids)
    torch.testing.assert_close(adv.double(), rloo_loop(rewards, mask, ids), **TOL)
    torch.testing.assert_close(ret, adv)
    if int(mask.sum()) >= 2:
        adv, ret = compute_reinforce_pp_baseline_advantage(rewards, mask, ids)
        torch.testing.assert_close(adv.double(), reinforce_pp_baseline_loop(rewards, mask, ids), **TOL)
        torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5, 0.0])
@pytest.mark.parametrize("b,width,seed", [(3, 1, 0), (5, 17, 1), (2, 300, 2)])
def test_reinforce_pp_matches_loop(gamma, b, width, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, width, generator=g)
    mask = torch.rand(b, width, generator=g) > 0.25  # masked tokens inside rows too: the return carries over
    mask[0, 0] = mask[-1, -1] = True
    adv, ret = compute_reinforce_pp_advantage(rewards, mask, gamma)
    adv_ref, ret_ref = reinforce_pp_loop(rewards, mask, gamma)
    torch.testing.assert_close(ret.double(), ret_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv.double(), adv_ref, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_small_gamma_long_rows_stay_finite():
    # 0.5 ** 2000 underflows float64: the scan must work in blocks and stay exact
    rewards, mask = torch.randn(2, 2000, dtype=torch.float64), torch.ones(2, 2000, dtype=torch.bool)
    mask[1, 1000] = False
    adv, ret = compute_reinforce_pp_advantage(rewards, mask, 0.5)
    _, ret_ref = reinforce_pp_loop(rewards, mask, 0.5)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(ret.double(), ret_ref, atol=1e-5, rtol=1e-5)


def test_remax_matches_loop():
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(6, 11, generator=g)
    mask = torch.rand(6, 11, generator=g) > 0.3
    base = torch.randn(6, generator=g)
    adv, ret = compute_remax_advantage(rewards, mask, base)
    adv_ref, ret_ref = remax_loop(rewards, mask, base)
    torch.testing.assert_close(adv.double(), adv_ref, **TOL)
    torch.testing.assert_close(ret.double(), ret_ref, **TOL)


# --- hand-computed cases ---------------------------------------------------------------------------

def test_grpo_hand_cases():
    # group a: scores 1, 0 (mean 0.5, unbiased std sqrt(0.5)); b: one sample (mean 0, std 1); c: all equal
    rewards, mask = _outcome([1.0, 0.0, 3.0, 0.1, 0.1, 0.1], width=3)
    ids = ["a", "a", "b", "c", "c", "c"]
    adv, _ = compute_grpo_advantage(rewards, mask, ids)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [s, -s, 3.0 / (1 + 1e-6), 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected)[:, None].expand(6, 3), atol=1e-6, rtol=1e-6)
    assert (adv[3:] == 0).all()  # all-equal group: exactly 0 (float64 statistics), not eps noise
    dr, _ = compute_grpo_advantage(rewards, mask, ids, norm_by_std=False)  # Dr.GRPO: no std division
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 3.0, 0.0, 0.0, 0.0])[:, None].expand(6, 3))


def test_why_grpo_keeps_its_kl_out_of_the_rewards():
    # Two correct answers whose KL penalties (in the reward) differ by 1e-5: GRPO's std division makes that noise an
    # advantage of +-0.62 (hand: mean 1 - 5e-6, unbiased std 1e-5 / sqrt 2; 5e-6 / (7.0711e-6 + 1e-6) = 0.61950),
    # as large as a real success/failure signal. So algo.kl_placement=auto puts GRPO's KL term in the loss.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0 - 1e-5]], dtype=torch.float64)  # float32 would round the 1e-5
    adv, _ = compute_grpo_advantage(rewards, torch.ones(2, 2, dtype=torch.bool), [0, 0])
    assert adv[0, 0].item() == pytest.approx(0.61950, abs=1e-4) and adv[1, 0].item() == pytest.approx(-0.61950, abs=1e-4)
    assert {get_advantage_estimator(n).kl_placement for n in ("grpo", "dr_grpo")} == {"loss"}
    assert {get_advantage_estimator(n).kl_placement for n in ("gae", "rloo", "remax")} == {"reward"}
    with pytest.raises(ValueError, match=r"kl_placement: expected 'reward' or 'loss', got 'critic'"):
        register_advantage_estimator("never_registered", kl_placement="critic")


def test_why_reinforce_pp_keeps_its_kl_out_of_the_rewards():
    # Every answer right, KL penalties in the rewards differing by 2e-4: whitening over the batch makes that noise an
    # advantage of +-0.577 (hand: mean 1 - 1e-4, unbiased var 2e-8, 1e-4 / sqrt(2e-8 + 1e-8)), nearly the +-0.707
    # of one right and one wrong answer (var 0.5). So algo.kl_placement=auto puts REINFORCE++'s KL term in the loss.
    mask = torch.ones(2, 1, dtype=torch.bool)
    noise, _ = compute_reinforce_pp_advantage(torch.tensor([[1.0], [1.0 - 2e-4]]), mask, 1.0)
    signal, _ = compute_reinforce_pp_advantage(torch.tensor([[1.0], [0.0]]), mask, 1.0)
    assert noise[:, 0].tolist() == pytest.approx([0.57735, -0.57735], abs=2e-3)  # float32 rounds the 2e-4
    assert signal[:, 0].tolist() == pytest.approx([0.70711, -0.70711], abs=1e-5)
    assert {get_advantage_estimator(n).kl_placement
            for n in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")} == {"loss"}


def test_score_is_the_sum_over_the_response_only():
    rewards = torch.tensor([[0.5, 0.5, float("nan")], [2.0, float("inf"), -7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv, _ = compute_grpo_advantage(rewards, mask, [0, 0], norm_by_std=False)
    # scores 1.0 and 2.0: mean 1.5; padding (NaN, inf, -7) never counts and stays 0
    torch.testing.assert_close(adv, torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))


def test_rloo_hand_cases():
    rewards, mask = _outcome([1.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    adv, _ = compute_rloo_advantage(rewards, mask, [0, 0, 0, 1, 2, 2])
    # 1 - (0 + 1)/2, 0 - (1 + 1)/2, ...; a group of one keeps its score; an all-equal group gives 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -1.0, 0.5, 5.0, 0.0, 0.0]))


def test_reinforce_pp_hand_case():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    _, ret = compute_reinforce_pp_advantage(rewards, mask, 0.5)
    # row 0: 3, 2 + 0.5 * 3, 1 + 0.5 * 3.5; row 1: the masked token passes the return on undiscounted
    torch.testing.assert_close(ret, torch.tensor([[2.75, 3.5, 3.0], [2.5, 0.0, 3.0]]))
    adv, _ = compute_reinforce_pp_advantage(rewards, mask, 0.5)
    vals = [2.75, 3.5, 3.0, 2.5, 3.0]
    mean = sum(vals) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4 + 1e-8)
    expected = [[(2.75 - mean) / std, (3.5 - mean) / std, (3.0 - mean) / std], [(2.5 - mean) / std, 0.0,
                                                                               (3.0 - mean) / std]]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_reinforce_pp_multi_turn_outcome_reaches_every_turn():
    # two assistant turns around a tool observation (masked), the outcome reward on the last turn
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.zeros(2, 4)
    rewards[0, 3] = rewards[1, 2] = 1.0
    adv, ret = compute_reinforce_pp_advantage(rewards, mask, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    assert (adv[~mask] == 0).all()
    # verl-project/verl#7300's gamma case: the observation span costs no discount step
    _, ret = compute_reinforce_pp_advantage(torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]),
                                            torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.bool), 0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0, 0.0, 0.0, 2.0, 0.0]]))
    # a reward on a masked token is not the model's and never enters the return
    _, ret = compute_reinforce_pp_advantage(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]).bool(), 1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0]]))


def test_reinforce_pp_baseline_hand_case():
    rewards, mask = _outcome([1.0, 0.0, 4.0], width=2, lengths=[2, 1, 2])
    adv, _ = compute_reinforce_pp_baseline_advantage(rewards, mask, [7, 7, 8])
    # centred: 0.5 (2 tokens), -0.5 (1 token), 4.0 (group of one, 2 tokens); whitened over the 5 tokens
    vals = [0.5, 0.5, -0.5, 4.0, 4.0]
    mean = sum(vals) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4 + 1e-8)
    expected = [[(0.5 - mean) / std] * 2, [(-0.5 - mean) / std, 0.0], [(4.0 - mean) / std] * 2]
    torch.testing.assert_close(adv, torch.tensor(expected))


def _verl_reinforce_pp_baseline(scores, lengths, ids, width):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage (volcengine/verl core_algos.py) in float64:
    score minus its group's mean (0 for a group of one) on every response token, then verl_F.masked_whiten over the
    response tokens: (x - mean) * rsqrt(unbiased var + 1e-8); its ``epsilon`` argument is never used."""
    groups = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    centred = [0.0] * len(scores)
    for members in groups.values():
        mean = 0.0 if len(members) == 1 else sum(scores[i] for i in members) / len(members)
        for i in members:
            centred[i] = scores[i] - mean
    vals = [centred[i] for i, n in enumerate(lengths) for _ in range(n)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(centred[i] - mean) / math.sqrt(var + 1e-8) if t < n else 0.0 for t in range(width)]
            for i, n in enumerate(lengths)]


def test_reinforce_pp_baseline_whitens_with_verls_epsilon_through_the_registry():
    """Issue 30 item 12: a small group's spread (variance ~1e-4) makes the whitening epsilon visible: 1e-6 instead
    of verl's 1e-8 moved the advantages by ~1e-2 relative. The registry entry is what PPOModel calls (with its
    default eps=1e-6 for the GRPO family)."""
    scores, lengths, ids = [0.5, 0.4921875, 0.515625, 0.484375], [3, 2, 3, 1], [0, 0, 1, 1]  # exact in float32
    rewards, mask = _outcome(scores, width=3, lengths=lengths)
    adv, ret = get_advantage_estimator("reinforce_plus_plus_baseline")(rewards, mask, group_index=ids)
    expected = torch.tensor(_verl_reinforce_pp_baseline(scores, lengths, ids, 3), dtype=torch.float64)
    torch.testing.assert_close(adv.double(), expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(ret, adv)


def test_remax_hand_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.25, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = compute_remax_advantage(rewards, mask, torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.75, 0.25, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [-0.25, -0.75, 0.0]]))


# --- edge cases and contracts ----------------------------------------------------------------------

def test_fully_masked_row_counts_in_its_group_with_score_zero():
    rewards, mask = _outcome([4.0, 2.0, 0.0], lengths=[4, 4, 0])
    adv, _ = compute_grpo_advantage(rewards, mask, [0, 0, 0], norm_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.0, 0.0, 0.0]))  # mean (4 + 2 + 0) / 3
    assert (adv[2] == 0).all()


def test_zero_width_and_single_sample():
    empty = torch.zeros(3, 0)
    m = torch.zeros(3, 0, dtype=torch.bool)
    for fn in (lambda: compute_grpo_advantage(empty, m, [0, 0, 1]), lambda: compute_rloo_advantage(empty, m, [0, 0, 1]),
               lambda: compute_remax_advantage(empty, m, torch.zeros(3))):
        adv, ret = fn()
        assert adv.shape == ret.shape == (3, 0)
    adv, _ = compute_grpo_advantage(torch.tensor([[2.0]]), torch.tensor([[True]]), [0])
    assert adv.item() == pytest.approx(2.0 / (1 + 1e-6))


@pytest.mark.parametrize("ids", [
    [10, 10, 11, 12, 11],
    ("x", "x", "y", "z", "y"),
    np.array([3, 3, 1, 2, 1]),
    np.array(["u1", "u1", "u2", "u3", "u2"], dtype=object),  # verl's uid strings
    torch.tensor([5, 5, -1, 0, -1]),
    [(0, "a"), (0, "a"), (1, "a"), 2, (1, "a")],  # any hashables, even of mixed types
])
def test_group_id_forms_agree(ids):
    rewards, mask = _outcome([1.0, 2.0, 3.0, 4.0, 6.0])
    adv, _ = compute_grpo_advantage(rewards, mask, ids)
    torch.testing.assert_close(adv, compute_grpo_advantage(rewards, mask, [0, 0, 1, 2, 1])[0])


def test_inputs_are_never_modified():
    for dtype in (torch.float32, torch.float64):
        rewards, mask, ids = _random_batch(9, 6, 5, 3)
        rewards = rewards.to(dtype)
        base = torch.randn(9, dtype=dtype)
        ids_t = torch.tensor(ids)
        copies = [rewards.clone(), mask.clone(), base.clone(), ids_t.clone()]
        compute_grpo_advantage(rewards, mask, ids_t)
        compute_rloo_advantage(rewards, mask, ids_t)
        compute_reinforce_pp_advantage(rewards, mask, 0.7)
        compute_reinforce_pp_baseline_advantage(rewards, mask, ids_t)
        compute_remax_advantage(rewards, mask, base)
        for before, after in zip(copies, [rewards, mask, base, ids_t]):
            assert torch.equal(before, after)


def test_whiten_fn_replaces_the_local_whitening():
    rewards, mask = _outcome([1.0, 0.0, 2.0])
    calls = []

    def scale_only(x, m):  # stands in for the trainer's data-parallel whitening
        calls.append(tuple(x.shape))
        return masked_whiten(x, m, shift_mean=False)

    adv, _ = compute_reinforce_pp_baseline_advantage(rewards, mask, [0, 0, 1], whiten_fn=scale_only)
    assert calls == [(3, 4)]
    torch.testing.assert_close(adv, masked_whiten(compute_grpo_advantage(rewards, mask, [0, 0, 1],
                                                                         norm_by_std=False)[0], mask, shift_mean=False))
    compute_reinforce_pp_advantage(rewards, mask, 1.0, whiten_fn=scale_only)
    assert len(calls) == 2


def test_errors_name_the_argument():
    r, m = _outcome([1.0, 2.0])
    with pytest.raises(ValueError, match="group_index has 3 entries but there are 2 samples"):
        compute_grpo_advantage(r, m, [0, 0, 1])
    with pytest.raises(TypeError, match=r"group_index as a tensor must be a 1-D integer tensor .* torch.float32"):
        compute_rloo_advantage(r, m, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="group_index must be a length-B sequence.* got str"):
        compute_rloo_advantage(r, m, "ab")
    with pytest.raises(TypeError, match="group_index entries must be hashable"):
        compute_grpo_advantage(r, m, [[0], [1]])
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(B, R\), got shape \(4,\)"):
        compute_grpo_advantage(r[0], m[0], [0])
    with pytest.raises(ValueError, match=r"shape mismatch: response_mask has shape \(2, 3\) but token_rewards"):
        compute_rloo_advantage(r, m[:, :3], [0, 1])
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got 0.0"):
        compute_grpo_advantage(r, m, [0, 1], eps=0.0)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.1"):
        compute_reinforce_pp_advantage(r, m, 1.1)
    with pytest.raises(ValueError, match=r"baseline_scores must have shape \(B,\) = \(2,\), got shape \(2, 1\)"):
        compute_remax_advantage(r, m, torch.zeros(2, 1))
    with pytest.raises(TypeError, match="baseline_scores must be a floating tensor"):
        compute_remax_advantage(r, m, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="masked_whiten needs at least 2 valid"):
        compute_reinforce_pp_advantage(r[:1], torch.tensor([[True, False, False, False]]), 1.0)
