"""PPOModel.compute_advantage on hand-built cases: GAE with the KL in the reward (k1, abs), whitening, hot switches
read at call time, GRPO / Dr.GRPO / RLOO / ReMax. Every expected number is written down or derived in a comment
(ppo_testutil); none comes from ``verl_ds.algos``."""
import math
import statistics

import pytest
import torch

from models_testutil import EOS, PAD
from ppo_testutil import GAE_ADV, GAE_RET, GAE_REWARDS, assert_scalar_metrics, batch_of, close, gae_batch, make_ppo, t


def test_gae_with_kl_in_reward_hand_case():
    ppo = make_ppo(whiten_advantages=False)
    ppo.state.update({"kl_coef": 0.5, "kl_kind": "k1", "kl_ctrl_type": "fixed", "gamma": 0.5, "lam": 0.5})
    b = gae_batch()
    metrics = ppo.compute_advantage(b)
    close(b.token_rewards, GAE_REWARDS)
    close(b.advantages, GAE_ADV)
    close(b.returns, GAE_RET)
    assert_scalar_metrics(metrics)
    # per-sample mean KL: row 0 (0.2 + 0 - 0.1) / 3, row 1 0.5 / 2; batch mean
    assert float(metrics["actor/reward_kl_penalty"]) == pytest.approx((0.1 / 3 + 0.25) / 2, abs=1e-6)
    assert float(metrics["actor/reward_kl_penalty_coeff"]) == 0.5
    assert float(metrics["rollout/score/mean"]) == 1.5 and float(metrics["rollout/score/max"]) == 2.0
    assert float(metrics["rollout/rewards/mean"]) == pytest.approx((0.95 + 1.75) / 2, abs=1e-6)
    assert float(metrics["critic/values/mean"]) == pytest.approx((0.5 + 0.2 + 0.4 + 1.0 - 1.0) / 5, abs=1e-6)
    assert float(metrics["rollout/advantages/max"]) == pytest.approx(2.75)
    assert float(metrics["rollout/returns/min"]) == pytest.approx(0.040625)


def test_gae_whitening_default_and_custom():
    ppo = make_ppo()  # algo.whiten_advantages defaults to True
    ppo.state.update({"kl_coef": 0.5, "kl_kind": "k1", "kl_ctrl_type": "fixed", "gamma": 0.5, "lam": 0.5})
    b = gae_batch()
    ppo.compute_advantage(b)
    flat = [a for row, n in zip(GAE_ADV, (3, 2)) for a in row[:n]]
    mean, std = statistics.mean(flat), statistics.stdev(flat)  # unbiased, over the 5 response tokens
    want = [[(a - mean) / math.sqrt(std ** 2 + 1e-8) for a in row] for row in GAE_ADV]
    want[1][2] = 0.0
    close(b.advantages, want, atol=1e-5)
    close(b.returns, GAE_RET)  # returns are not whitened
    calls = []

    def double(x, mask):
        calls.append(mask.tolist())
        return x * 2

    ppo.compute_advantage(b, whiten_fn=double)
    assert calls == [b.response_mask.tolist()]
    close(b.advantages, [[2 * a for a in row] for row in GAE_ADV])


def test_kl_coef_and_switches_read_at_call_time():
    ppo = make_ppo(whiten_advantages=False)
    ppo.state.update({"kl_kind": "k1", "kl_ctrl_type": "fixed", "kl_coef": 0.0})
    b = gae_batch()
    metrics = ppo.compute_advantage(b)
    close(b.token_rewards, b.scores)  # no KL term at all
    assert "actor/reward_kl_penalty" not in metrics
    ppo.state.set("kl_coef", 1.0)
    ppo.compute_advantage(b)
    close(b.token_rewards, [[-0.2, 0.0, 1.1], [0.0, 1.5, 0.0]])  # scores - 1.0 * KL
    ppo.state.set("kl_kind", "abs")
    ppo.compute_advantage(b)
    close(b.token_rewards, [[-0.2, 0.0, 0.9], [0.0, 1.5, 0.0]])  # |KL|
    ppo.state.set("use_kl_penalty", False)
    ppo.compute_advantage(b)
    close(b.token_rewards, b.scores)


@pytest.mark.parametrize("estimator, groups, scores, want", [
    # GRPO: group 0 scores (1, 0): mean 0.5, unbiased std sqrt(0.5); A = +-0.5 / (sqrt(0.5) + 1e-6)
    # group 1 scores (3, 3): std 0, A = 0
    ("grpo", [0, 0, 1, 1], [1, 0, 3, 3], [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0, 0]),
    ("dr_grpo", [0, 0, 1, 1], [1, 0, 3, 3], [0.5, -0.5, 0, 0]),
    # RLOO: group (1, 0, 2): each minus the mean of the other two; a group of one has baseline 0
    ("rloo", [0, 0, 0, 1], [1, 0, 2, 5], [0 - 0, 0 - 1.5, 2 - 0.5, 5]),
])
def test_critic_free_group_estimators_hand_cases(estimator, groups, scores, want):
    ppo = make_ppo(estimator, critic=False)  # whiten_advantages stays True: the group estimators normalise themselves
    assert not ppo.needs_critic and ppo.critic is None
    ppo.state.update({"kl_coef": 0.0, "kl_ctrl_type": "fixed"})
    b = batch_of([[4, EOS, PAD], [4, 5, EOS], [6, EOS, PAD], [4, 5, 6]])
    lengths = b.response_length.tolist()
    assert lengths == [2, 3, 2, 3]
    b.scores = torch.zeros(4, 3)
    b.scores[torch.arange(4), b.response_length - 1] = t(scores)
    b.group_index = torch.tensor(groups)
    ppo.compute_advantage(b)
    expected = [[w if j < n else 0.0 for j in range(3)] for w, n in zip(want, lengths)]
    close(b.advantages, expected, atol=1e-5)
    close(b.returns, expected, atol=1e-5)
    b.group_index = None
    with pytest.raises(ValueError, match="PPOModel.compute_advantage: batch.group_index is missing"):
        ppo.compute_advantage(b)


def test_remax_hand_case():
    ppo = make_ppo("remax", critic=False)
    ppo.state.update({"kl_coef": 0.0, "kl_ctrl_type": "fixed"})
    b = batch_of([[4, EOS, PAD], [4, 5, 6]])
    b.scores = t([[0, 1, 0], [0.5, 0, 2]])
    with pytest.raises(ValueError, match="algo.adv_estimator='remax' needs baseline_scores"):
        ppo.compute_advantage(b)
    ppo.compute_advantage(b, baseline_scores=t([0.25, 1.0]))
    # returns: reverse cumulative sums of each row's rewards; advantages: returns - the row's baseline
    close(b.returns, [[1, 1, 0], [2.5, 2, 2]])
    close(b.advantages, [[0.75, 0.75, 0], [1.5, 1.0, 1.0]])
