"""PPOModel.compute_policy_loss and compute_value_loss on hand-built cases: clipped surrogate with dual clip (values,
metrics, the gradient reaching the bigram actor's table), entropy bonus, normalizer and aggregation mode, the KL in
the loss (k3) with its gradient, the clipped value loss with its gradients and cliprange_value 0."""
import math

import pytest
import torch

from verl_ds.models import MissingModuleError

from models_testutil import EOS
from ppo_testutil import (ADVANTAGES, MEAN_ENTROPY, RATIOS, ROWS, TOKEN_LOSSES, assert_scalar_metrics, make_ppo,
                          policy_batch, t, value_batch)


# ---- the policy loss -----------------------------------------------------------------------------------------------

def test_policy_loss_hand_case_metrics_and_gradient():
    ppo = make_ppo()
    ppo.state.update({"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "entropy_coef": 0.0, "kl_coef": 0.0,
                      "kl_ctrl_type": "fixed", "temperature": 1.0})
    b = policy_batch(RATIOS, ADVANTAGES)
    loss, metrics = ppo.compute_policy_loss(b)
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / 4, abs=1e-6)  # token-mean: 0.4
    assert_scalar_metrics(metrics)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(0.4, abs=1e-6)
    assert float(metrics["actor/pg_clipfrac"]) == 0.5  # tokens 1 and 3
    assert float(metrics["actor/pg_clipfrac_lower"]) == 0.25  # token 4
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(-math.log(1.5 * 0.5 * 0.5 * 5.0) / 4, abs=1e-6)
    assert float(metrics["actor/entropy"]) == pytest.approx(MEAN_ENTROPY, abs=1e-6)
    assert "actor/kl_loss" not in metrics
    loss.backward()
    # only token 2 (ratio 0.5, A=2, row 4 -> 5) is unclipped: dL/dlog_p = -A * ratio / 4 = -0.25, and
    # dlog p(5|4)/dlogits[4] = onehot(5) - p(.|4); so grad logits[4] = 0.25 (p - onehot(5)): -1/16 on 5, 1/16 on EOS
    grad = ppo.actor.lm.table.grad
    want = torch.zeros_like(grad)
    want[4, 5], want[4, EOS] = -1 / 16, 1 / 16
    torch.testing.assert_close(grad, want, atol=1e-7, rtol=0)


def test_entropy_bonus_normalizer_and_agg_mode():
    ppo = make_ppo()
    ppo.state.update({"kl_coef": 0.0, "kl_ctrl_type": "fixed", "entropy_coef": 0.1})
    b = policy_batch(RATIOS, ADVANTAGES)
    loss, _ = ppo.compute_policy_loss(b)
    assert loss.item() == pytest.approx(0.4 - 0.1 * MEAN_ENTROPY, abs=1e-6)
    ppo.state.set("entropy_coef", 0.0)
    loss, _ = ppo.compute_policy_loss(b, normalizer=8)  # the token sum 1.6 over 8 instead of 4
    assert loss.item() == pytest.approx(0.2, abs=1e-6)
    seq = make_ppo(loss_agg_mode="seq-mean-token-sum")
    seq.state.update({"kl_coef": 0.0, "kl_ctrl_type": "fixed"})
    loss, _ = seq.compute_policy_loss(b)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.8 + 3.0) / 2, abs=1e-6)  # row sums -2.2 and 3.8, averaged


def test_dr_grpo_aggregates_token_sums_over_the_generation_budget_by_default():
    """Issue 30 item 11: Dr.GRPO (Liu et al. 2025) divides each sequence's token sum by a constant, the generation
    budget (verl's seq-mean-token-sum-norm), not by the token count; ``algo.loss_agg_mode=auto`` (the default) is
    that for dr_grpo and token-mean for the others, as ``algo.kl_placement=auto`` follows the estimator."""
    dr, grpo = make_ppo("dr_grpo", critic=False, ref=False), make_ppo("grpo", critic=False, ref=False)
    assert dr.algo.loss_agg_mode == grpo.algo.loss_agg_mode == "auto"
    assert (dr.loss_agg_mode, grpo.loss_agg_mode) == ("seq-mean-token-sum-norm", "token-mean")
    b = policy_batch(RATIOS, ADVANTAGES)  # token losses: row sums -2.2 and 3.8 over 4 tokens (see above)
    for ppo in (dr, grpo):
        ppo.state.update({"kl_coef": 0.0, "kl_ctrl_type": "fixed", "entropy_coef": 0.0, "max_new_tokens": 8})
    assert dr.compute_policy_loss(b)[0].item() == pytest.approx(1.6 / (2 * 8), abs=1e-6)  # 2 sequences x budget 8
    assert dr.compute_policy_loss(b, normalizer=4)[0].item() == pytest.approx(1.6 / (4 * 8), abs=1e-6)
    assert grpo.compute_policy_loss(b)[0].item() == pytest.approx(1.6 / 4, abs=1e-6)
    explicit = make_ppo("dr_grpo", critic=False, ref=False, loss_agg_mode="token-mean")
    explicit.state.update({"kl_coef": 0.0, "kl_ctrl_type": "fixed", "entropy_coef": 0.0})
    assert explicit.loss_agg_mode == "token-mean" and explicit.compute_policy_loss(b)[0].item() == pytest.approx(0.4)


def test_auto_kl_placement_is_the_estimators():
    grpo, gae = make_ppo("grpo", critic=False), make_ppo()
    assert grpo.algo.kl_placement == gae.algo.kl_placement == "auto"
    assert grpo.kl_in_loss() and not grpo.kl_in_reward()
    assert gae.kl_in_reward() and not gae.kl_in_loss()
    assert make_ppo("grpo", critic=False, kl_placement="reward").kl_in_reward()


def test_kl_in_loss_hand_case_and_gradient():
    ppo = make_ppo(kl_placement="loss")
    ppo.state.update({"kl_coef": 0.5, "kl_kind": "k3", "kl_ctrl_type": "fixed", "entropy_coef": 0.0})
    b = policy_batch([[1.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]])  # the surrogate contributes nothing
    x = [[0.1, -0.2], [0.0, 0.3]]  # ref_log_probs - log_probs
    b.ref_log_probs = b.old_log_probs + t(x)
    loss, metrics = ppo.compute_policy_loss(b)
    k3 = [math.exp(v) - 1 - v for row in x for v in row]  # exp(-d) - 1 + d with d = log_probs - ref = -x
    assert float(metrics["actor/kl_loss"]) == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert float(metrics["actor/kl_coef"]) == 0.5
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 4, abs=1e-6)
    loss.backward()
    # d k3 / d log_p = 1 - exp(x): row 3 gets it from tokens (0, 0) (x = 0.1) and (1, 0) (x = 0: nothing)
    grad = ppo.actor.lm.table.grad
    g = 0.5 / 4 * (1 - math.exp(0.1))
    want3 = torch.tensor([g * ((b_ == 4) - ROWS[3].get(b_, 0) / 4) for b_ in range(grad.shape[1])])
    torch.testing.assert_close(grad[3], want3, atol=1e-7, rtol=0)
    assert all(p.grad is None for p in ppo.ref.lm.parameters())  # the reference is not even called
    ppo.state.set("kl_coef", 0.0)  # a fixed zero coefficient: no KL term, no metric
    loss0, metrics0 = ppo.compute_policy_loss(b)
    assert loss0.item() == 0.0 and "actor/kl_loss" not in metrics0


# ---- the value loss ------------------------------------------------------------------------------------------------

def test_value_loss_hand_case_and_gradient():
    ppo = make_ppo()
    ppo.state.set("cliprange_value", 0.2)
    b = value_batch()
    loss, metrics = ppo.compute_value_loss(b)
    # token 0: V 0.5, V_old 0 -> V_clip 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped)
    # token 1: V 1.0, V_old 0.9 -> V_clip 1.0: (1 - 0)^2 = 1.   loss = 0.5 * mean(0.64, 1) = 0.41
    assert loss.item() == pytest.approx(0.41, abs=1e-6)
    assert_scalar_metrics(metrics)
    assert float(metrics["critic/vf_loss"]) == pytest.approx(0.41, abs=1e-6)
    assert float(metrics["critic/vf_clipfrac"]) == 0.5
    assert float(metrics["critic/vpred_mean"]) == pytest.approx(0.75)
    # 1 - Var(R - V) / Var(R) = 1 - Var(0.5, -1) / Var(1, 0) = 1 - 0.5625 / 0.25
    assert float(metrics["critic/vf_explained_var"]) == pytest.approx(-1.25, abs=1e-6)
    loss.backward()
    grad = ppo.critic.net.table.grad  # token 0 clipped: no gradient; token 1: 0.5 * 0.5 * 2 * (1 - 0)
    assert grad[3].item() == 0.0 and grad[4].item() == pytest.approx(0.5)
    ppo.critic.net.table.grad = None
    ppo.state.set("cliprange_value", 0.0)  # 0 disables clipping: 0.5 * mean(0.25, 1)
    loss, _ = ppo.compute_value_loss(b)
    assert loss.item() == pytest.approx(0.3125, abs=1e-6)
    loss.backward()
    assert ppo.critic.net.table.grad[3].item() == pytest.approx(-0.25)  # 0.5 * (0.5 - 1)


def test_value_loss_needs_a_critic():
    ppo = make_ppo("grpo", critic=False)
    with pytest.raises(MissingModuleError, match=r"^Missing required module: critic \(compute_value_loss needs a "
                                                 r"ValueModel\)$"):
        ppo.compute_value_loss(value_batch())
