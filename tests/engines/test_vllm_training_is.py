"""Truncated importance sampling (rollout.is_correction): the weights min(exp(old_log_probs - rollout_log_probs), cap)
against a float64 loop and hand-computed cases, in policy_loss and in PPOModel.compute_policy_loss (the hand-built
bigram actor of tests/models), and the bad-input errors. Runs in the main venv (no vLLM needed)."""
import math

import pytest
import torch
from algos_refs import ppo_token_loss

from verl_ds.algos import agg_loss, policy_loss
from verl_ds.algos.mismatch import truncated_is_weights
from verl_ds.models import PPOModel

from models_testutil import EOS
from ppo_testutil import ADVANTAGES, RATIOS, make_ppo, policy_batch, t


def is_weights_loop(old, rollout, mask, cap):
    """Per token, in float64: min(p_trainer / p_sampler, cap) on valid tokens, 0 elsewhere; mean and capped share."""
    w = [[min(math.exp(o - r), cap) if m else 0.0 for o, r, m in zip(orow, rrow, mrow)]
         for orow, rrow, mrow in zip(old.tolist(), rollout.tolist(), mask.tolist())]
    valid = [(o, r) for orow, rrow, mrow in zip(old.tolist(), rollout.tolist(), mask.tolist())
             for o, r, m in zip(orow, rrow, mrow) if m]
    mean = sum(min(math.exp(o - r), cap) for o, r in valid) / len(valid)
    capped = sum(math.exp(o - r) > cap for o, r in valid) / len(valid)
    return torch.tensor(w, dtype=torch.float64), mean, capped


def test_weights_hand_case():
    old = torch.log(t([[0.5, 0.2, 0.3]]))
    rollout = torch.log(t([[0.25, 0.4, 0.9]]))  # ratios 2, 0.5 and (padding) 1/3
    mask = torch.tensor([[True, True, False]])
    w, metrics = truncated_is_weights(old, rollout, mask, cap=1.5)
    torch.testing.assert_close(w, t([[1.5, 0.5, 0.0]]), atol=1e-6, rtol=0)
    assert float(metrics["is_weight_mean"]) == pytest.approx(1.0, abs=1e-6)  # (1.5 + 0.5) / 2
    assert float(metrics["is_capped_frac"]) == pytest.approx(0.5)
    assert not w.requires_grad and all(v.dim() == 0 for v in metrics.values())


def test_weights_match_the_float64_loop():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=g) * 3
    rollout = old + torch.randn(6, 9, generator=g) * 0.8  # ratios from ~0.1 to ~10: some capped
    mask = torch.rand(6, 9, generator=g) > 0.3
    shares = []
    for cap in (1.0, 2.0, 5.0):
        w, metrics = truncated_is_weights(old, rollout, mask, cap)
        ref, mean, capped = is_weights_loop(old, rollout, mask, cap)
        torch.testing.assert_close(w.double(), ref, atol=1e-5, rtol=1e-5)
        assert float(metrics["is_weight_mean"]) == pytest.approx(mean, rel=1e-5)
        assert float(metrics["is_capped_frac"]) == pytest.approx(capped)
        shares.append(capped)
    assert 0 < shares[1] < shares[0] < 1, f"capped shares {shares}: the case proves little"


def test_non_finite_values_on_padding_never_reach_a_weight():
    old = t([[-1.0, float("nan")]])
    rollout = t([[-1.0, float("-inf")]])
    w, metrics = truncated_is_weights(old, rollout, torch.tensor([[True, False]]), cap=2.0)
    assert w.tolist() == [[1.0, 0.0]] and float(metrics["is_weight_mean"]) == 1.0


def test_policy_loss_weights_each_token_loss_and_not_the_gradient_path():
    g = torch.Generator().manual_seed(4)
    lp = (-torch.rand(3, 5, generator=g) * 2).requires_grad_()
    old = lp.detach() + torch.randn(3, 5, generator=g) * 0.3
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.2
    w = torch.rand(3, 5, generator=g) * 2
    loss, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, 3.0, "token-mean", is_weights=w)
    per_tok = torch.zeros(3, 5, dtype=torch.float64)
    for i in range(3):
        for j in range(5):
            per_tok[i, j] = ppo_token_loss(float(lp.detach()[i, j]), float(old[i, j]), float(adv[i, j]), 0.2, 0.28, 3.0)[0] \
                * float(w[i, j])
    assert loss.item() == pytest.approx(agg_loss(per_tok, mask, "token-mean").item(), rel=1e-5)
    loss.backward()
    unweighted = lp.detach().clone().requires_grad_()
    policy_loss(unweighted, old, adv, mask, 0.2, 0.28, 3.0, "token-mean")[0].backward()
    torch.testing.assert_close(lp.grad, unweighted.grad * w * mask, atol=1e-7, rtol=1e-5)
    ones, _ = policy_loss(lp.detach(), old, adv, mask, is_weights=torch.ones(3, 5))
    assert ones.item() == policy_loss(lp.detach(), old, adv, mask)[0].item()


def test_ppo_model_hand_case():
    """The policy-loss hand case of tests/models (token losses -1.2, -1.0, 0.8, 3.0) with sampler log-probs whose
    ratios to the trainer's are 1, 3, 0.5, 1.9: cap 2 weights them 1, 2, 0.5, 1.9."""
    ppo = make_ppo()
    ppo.state.update({"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "entropy_coef": 0.0, "kl_coef": 0.0,
                      "kl_ctrl_type": "fixed", "temperature": 1.0})
    b = policy_batch(RATIOS, ADVANTAGES)
    b.rollout_log_probs = b.old_log_probs - torch.log(t([[1.0, 3.0], [0.5, 1.9]]))
    plain, plain_metrics = ppo.compute_policy_loss(b)
    assert plain.item() == pytest.approx(0.4, abs=1e-6) and "actor/is_weight_mean" not in plain_metrics
    ppo.is_cap = 2.0
    loss, metrics = ppo.compute_policy_loss(b)
    assert loss.item() == pytest.approx((-1.2 - 2.0 + 0.4 + 5.7) / 4, abs=1e-6)
    assert float(metrics["actor/is_weight_mean"]) == pytest.approx((1 + 2 + 0.5 + 1.9) / 4, abs=1e-6)
    assert float(metrics["actor/is_capped_frac"]) == 0.25
    loss.backward()
    # only token 2 (ratio 0.5, A=2, row 4 -> 5) is unclipped: dL/dlog_p = -A * ratio * w / 4 = -0.5, so the
    # gradient on logits[4] is 0.5 (p(.|4) - onehot(5)) with p(5|4) = 3/4: -1/8 on 5, 1/8 on EOS
    want = torch.zeros_like(ppo.actor.lm.table.grad)
    want[4, 5], want[4, EOS] = -1 / 8, 1 / 8
    torch.testing.assert_close(ppo.actor.lm.table.grad, want, atol=1e-7, rtol=0)
    b.rollout_log_probs = None
    with pytest.raises(ValueError, match=r"batch.rollout_log_probs is missing"):
        ppo.compute_policy_loss(b)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cap=0.5), ValueError, r"cap must be >= 1 .* got 0.5"),
    (dict(cap=float("inf")), ValueError, "cap must be a finite number > 0, got inf"),
    (dict(cap="2"), TypeError, "cap must be a real number, got str"),
    (dict(rollout_log_probs=torch.zeros(2, 4)), ValueError, "rollout_log_probs"),
    (dict(rollout_log_probs=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "rollout_log_probs"),
])
def test_weights_reject_bad_input(kwargs, error, match):
    args = dict(old_log_probs=torch.zeros(2, 3), rollout_log_probs=torch.zeros(2, 3),
                response_mask=torch.ones(2, 3, dtype=torch.bool), cap=2.0)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        truncated_is_weights(**args)


def test_policy_loss_and_ppo_model_reject_bad_weights_and_caps():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(x, x, x, torch.ones(2, 3, dtype=torch.bool), is_weights=torch.ones(2, 4))
    ppo = make_ppo()
    for bad in (0.9, True, "2"):
        with pytest.raises(ValueError, match=r"is_cap must be None .* or a number >= 1, got"):
            PPOModel(ppo.actor, ppo.reward, critic=ppo.critic, ref=ppo.ref, state=ppo.state, algo=ppo.algo,
                     is_cap=bad)
