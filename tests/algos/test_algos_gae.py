"""verl_ds.algos.compute_gae: verl's masked-carry semantics against a float64 per-step loop."""
import pytest
import torch
from algos_refs import gae_loop, verl_gae_vectorized_loop

from verl_ds.algos import compute_gae
from verl_ds.algos import gae as gae_module

COEFS = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (1.0, 0.5), (0.5, 0.5)]


def _check(rewards, values, mask, gamma, lam, atol=1e-5):
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    adv_ref, ret_ref = gae_loop(rewards, values, mask, gamma, lam)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32 and adv.shape == rewards.shape
    torch.testing.assert_close(adv.double(), adv_ref, atol=atol, rtol=1e-6)
    torch.testing.assert_close(ret.double(), ret_ref, atol=atol, rtol=1e-6)
    return adv, ret


def test_hand_computed_three_steps():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 1.5]])
    m = torch.ones(1, 3, dtype=torch.bool)
    g, lam = 0.9, 0.8
    d2 = 2.0 - 1.5
    d1 = 0.0 + g * 1.5 - 1.0
    d0 = 1.0 + g * 1.0 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    adv, ret = compute_gae(r, v, m, g, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 1.0, a2 + 1.5]]))


def test_masked_hole_is_bridged_without_extra_decay():
    # token 1 is an observation span: token 0 bootstraps from token 2's value, one gamma*lam step
    r = torch.tensor([[1.0, 100.0, 2.0]])
    v = torch.tensor([[0.5, -7.0, 1.5]])
    m = torch.tensor([[True, False, True]])
    g, lam = 0.9, 0.8
    a2 = 2.0 - 1.5
    a0 = (1.0 + g * 1.5 - 0.5) + g * lam * a2
    adv, ret = compute_gae(r, v, m, g, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a2, a2]]))  # the hole holds the carry
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a2 - 7.0, a2 + 1.5]]))


def test_t_equals_one():
    r, v = torch.tensor([[2.0], [3.0]]), torch.tensor([[0.5], [1.0]])
    adv, ret = compute_gae(r, v, torch.tensor([[True], [False]]), 0.99, 0.95)
    torch.testing.assert_close(adv, torch.tensor([[1.5], [0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0], [1.0]]))


@pytest.mark.parametrize("gamma,lam", COEFS)
def test_random_masks_match_the_loop(gamma, lam):
    rewards, values = torch.randn(6, 45), torch.randn(6, 45)
    mask = torch.rand(6, 45) > 0.35
    mask[0] = False  # an all-masked row
    mask[1] = True
    adv, _ = _check(rewards, values, mask, gamma, lam)
    assert torch.equal(adv[0], torch.zeros(45))


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0)])
def test_left_and_right_padding(gamma, lam):
    rewards, values = torch.randn(4, 30), torch.randn(4, 30)
    mask = torch.zeros(4, 30, dtype=torch.bool)
    mask[0, :18] = True  # right padding
    mask[1, 7:] = True  # left padding
    mask[2, 5:21] = True  # both
    mask[3, 3:9] = True
    mask[3, 14:25] = True  # a hole in the middle as well
    # garbage (even NaN) in padded rewards/values must not reach any valid token
    rewards_bad = rewards.masked_fill(~mask, float("nan"))
    values_bad = values.masked_fill(~mask, float("nan"))
    adv, ret = compute_gae(rewards_bad, values_bad, mask, gamma, lam)
    adv_ref, ret_ref = gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), adv_ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(ret.double()[mask], ret_ref[mask], atol=1e-5, rtol=1e-6)
    # trailing padding bootstraps from 0: the last valid token's advantage is r - V
    torch.testing.assert_close(adv[0, 17], rewards[0, 17] - values[0, 17])


def test_matches_verl_float32_loop_and_accepts_a_float_mask():
    rewards, values = torch.randn(8, 70), torch.randn(8, 70)
    mask = (torch.rand(8, 70) > 0.2).float()
    adv, ret = compute_gae(rewards, values, mask, 0.97, 0.9)
    adv_v, ret_v = verl_gae_vectorized_loop(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(adv, adv_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ret_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.6), (0.2, 0.1)])
def test_long_sequences_across_chunks_and_blocks(gamma, lam, monkeypatch):
    # small row chunks, and for small gamma*lam several scan blocks (weights kept above 1e-200)
    monkeypatch.setattr(gae_module, "_CHUNK_ELEMS", 1500)
    rewards, values = torch.randn(3, 1200, dtype=torch.float64), torch.randn(3, 1200, dtype=torch.float64)
    mask = torch.rand(3, 1200) > 0.1
    mask[2, 600:] = False
    _check(rewards, values, mask, gamma, lam, atol=1e-5)
    if gamma * lam < 0.9:
        assert gae_module._block_len(gamma * lam, 1200) < 1200  # the multi-block path ran


def test_float64_and_bf16_inputs_give_float32():
    rewards, values = torch.randn(2, 9), torch.randn(2, 9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    for dt in (torch.float64, torch.bfloat16):
        adv, ret = compute_gae(rewards.to(dt), values.to(dt), mask, 0.9, 0.9)
        assert adv.dtype == ret.dtype == torch.float32
        adv_ref, _ = gae_loop(rewards.to(dt), values.to(dt), mask, 0.9, 0.9)
        torch.testing.assert_close(adv.double(), adv_ref, atol=1e-5, rtol=1e-6)


def test_errors_name_the_argument():
    r, v = torch.zeros(2, 3), torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"shape mismatch: values has shape \(2, 4\) but token_rewards has shape "
                                         r"\(2, 3\)"):
        compute_gae(r, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match=r"shape mismatch: response_mask has shape \(2, 1\) but token_rewards"):
        compute_gae(r, v, m[:, :1])
    with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1 .* got a value 0.5"):
        compute_gae(r, v, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match=r"token_rewards must have shape \(B, R\), got shape \(6,\)"):
        compute_gae(r.view(6), v.view(6), m.view(6))
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        compute_gae(r, v, m, gamma=1.5)
    with pytest.raises(ValueError, match="lam must be a finite number >= 0, got -0.1"):
        compute_gae(r, v, m, lam=-0.1)
    with pytest.raises(TypeError, match="values must be a floating tensor .* got dtype torch.int64"):
        compute_gae(r, v.long(), m)
