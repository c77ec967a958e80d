"""PPOModel on hand-built cases: every expected number is written down (or derived in a comment) from a bigram actor
whose probabilities are known, a critic whose values are a table, and literal batch fields; none comes from
``verl_ds.algos``. Covers GAE with the KL in the reward, the critic-free estimators, the clipped surrogate with dual
clip, the entropy bonus, the KL in the loss, the clipped value loss (with gradients), the KL controller, state_dict,
hot swap and the error messages."""
import dataclasses
import math
import statistics

import pytest
import torch

from verl_ds.batch import RolloutBatch
from verl_ds.config import AlgoConfig
from verl_ds.models import MissingModuleError, PolicyModel, PPOModel, ReferenceModel, RewardModel, ValueModel
from verl_ds.registry import ModelRegistry
from verl_ds.state import SharedState

from models_testutil import EOS, PAD, TokenValueNet, make_bigram_lm

ROWS = {3: {4: 1, 5: 1, 6: 2}, 4: {5: 3, EOS: 1}, 6: {EOS: 3, 3: 1}}  # p(b | a) = weight / row sum


def H(*ps):
    return -sum(q * math.log(q) for q in ps)


def make_ppo(adv_estimator="gae", critic=True, ref=True, values=None, **algo):
    state = SharedState(rank=0)
    algo = dataclasses.replace(AlgoConfig(), adv_estimator=adv_estimator, **algo)
    reward = RewardModel()
    reward.register_reward_fn(lambda p, r, b: [1.0] * len(p), name="one")
    return PPOModel(PolicyModel(make_bigram_lm(ROWS)), reward,
                    critic=ValueModel(TokenValueNet(values or {3: 0.5, 4: 1.0})) if critic else None,
                    ref=ReferenceModel(make_bigram_lm(ROWS)) if ref else None, state=state, algo=algo)


def batch_of(responses, prompt=3):
    """Prompt [prompt] for every row, the given responses (EOS ends a row; the rest is padding)."""
    responses = torch.tensor(responses)
    prompts = torch.full((responses.shape[0], 1), prompt)
    return RolloutBatch.from_generation(prompts, torch.ones_like(prompts, dtype=torch.bool), responses,
                                        pad_token_id=PAD, eos_token_id=EOS)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(x, want, atol=1e-6):
    torch.testing.assert_close(x.float(), torch.as_tensor(want, dtype=torch.float32), atol=atol, rtol=0)


def assert_scalar_metrics(metrics):
    for key, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, key


# ---- advantages ---------------------------------------------------------------------------------------------------

def gae_batch():
    """B=2, R=3: row 0 three tokens, row 1 two (EOS) then padding."""
    b = batch_of([[4, 5, 6], [6, EOS, PAD]])
    assert b.response_mask.tolist() == [[True, True, True], [True, True, False]]
    b.scores = t([[0, 0, 1], [0, 2, 0]])
    b.values = t([[0.5, 0.2, 0.4], [1.0, -1.0, 99.0]])  # 99 sits on padding: must be ignored
    b.old_log_probs = t([[-1.0, -0.5, -0.2], [-0.3, -0.4, 0.0]])
    b.ref_log_probs = t([[-1.2, -0.5, -0.1], [-0.3, -0.9, 0.0]])
    return b


# k1 KL = old - ref = [[0.2, 0, -0.1], [0, 0.5, -]]; kl_coef 0.5: token rewards = scores - 0.5 KL
GAE_REWARDS = [[-0.1, 0.0, 1.05], [0.0, 1.75, 0.0]]
# gamma = lam = 0.5, V after the last real token = 0:
#   row 0: d2 = 1.05 - 0.4 = 0.65; d1 = 0 + 0.5*0.4 - 0.2 = 0; d0 = -0.1 + 0.5*0.2 - 0.5 = -0.5
#          A2 = 0.65, A1 = 0 + 0.25*0.65 = 0.1625, A0 = -0.5 + 0.25*0.1625 = -0.459375
#   row 1: d1 = 1.75 - (-1) = 2.75; d0 = 0 + 0.5*(-1) - 1 = -1.5; A1 = 2.75, A0 = -1.5 + 0.25*2.75 = -0.8125
GAE_ADV = [[-0.459375, 0.1625, 0.65], [-0.8125, 2.75, 0.0]]
GAE_RET = [[0.040625, 0.3625, 1.05], [0.1875, 1.75, 0.0]]  # A + V on the response


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


# ---- the policy loss ------------------------------------------------------------------------------------------------

def policy_batch(ratios, advantages):
    """Rows 3 -> 4 5 and 3 -> 6 EOS; old_log_probs set so that exp(log_probs - old_log_probs) = ratios."""
    b = batch_of([[4, 5], [6, EOS]])
    lp = [[math.log(1 / 4), math.log(3 / 4)], [math.log(1 / 2), math.log(3 / 4)]]  # from ROWS
    b.old_log_probs = t([[lp[i][j] - math.log(ratios[i][j]) for j in range(2)] for i in range(2)])
    b.advantages = t(advantages)
    b.ref_log_probs = t(lp)
    return b


# ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped); ratio 0.5, A=+2: max(-1.0, -1.6) = -1.0;
# ratio 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); ratio 5, A=-1: max(5, 1.2) = 5, dual clip min(5, 3) = 3.
RATIOS, ADVANTAGES, TOKEN_LOSSES = [[1.5, 0.5], [0.5, 5.0]], [[1.0, 2.0], [-1.0, -1.0]], [-1.2, -1.0, 0.8, 3.0]
MEAN_ENTROPY = (2 * H(1 / 4, 1 / 4, 1 / 2) + H(3 / 4, 1 / 4) + H(3 / 4, 1 / 4)) / 4  # rows 3, 4 | 3, 6


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


# ---- the value loss -------------------------------------------------------------------------------------------------

def value_batch():
    b = batch_of([[4, 5]])  # values before the response tokens: after 3 (0.5) and after 4 (1.0)
    b.values = t([[0.0, 0.9]])  # the rollout's
    b.returns = t([[1.0, 0.0]])
    return b


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


# ---- the KL controller ------------------------------------------------------------------------------------------------

def test_band_controller_rebuilds_and_adopts_hot_values():
    ppo = make_ppo()
    ppo.state.update({"kl_ctrl_type": "band", "kl_coef": 0.2, "target_kl": 0.1})
    for observed, want in ((0.2, 0.3), (0.01, 0.24), (0.1, 0.24)):  # > 1.5 target: x1.5; < 0.5 target: x0.8
        ppo.update(None, {"observed_kl": observed, "n_samples": 4})
        assert ppo.state["kl_coef"] == pytest.approx(want)
    ppo.state.set("kl_ctrl_type", "fixed")
    ppo.update(None, {"observed_kl": 5.0, "n_samples": 4})
    assert ppo.state["kl_coef"] == pytest.approx(0.24) and ppo.kl_controller.name == "fixed"
    ppo.state.update({"kl_coef": 0.7, "kl_ctrl_type": "band"})  # a hot coefficient is adopted
    ppo.update(None, {"observed_kl": 1.0, "n_samples": 4})
    assert ppo.state["kl_coef"] == pytest.approx(1.05)
    ppo.state.set("kl_coef", 900.0)
    ppo.update(None, {"observed_kl": 1.0, "n_samples": 4})  # 1350 is clamped to the key's range
    assert ppo.state["kl_coef"] == 1000.0


def test_ziegler_controller_hand_step():
    ppo = make_ppo()
    ppo.state.update({"kl_ctrl_type": "ziegler", "kl_coef": 0.1, "target_kl": 0.05})
    ppo.update(None, {"observed_kl": 0.5, "n_samples": 1000})  # error 0.5/0.05 - 1 clipped to 0.2, horizon 10000
    assert ppo.state["kl_coef"] == pytest.approx(0.1 * (1 + 0.2 * 1000 / 10000))
    assert ppo.kl_controller.value == pytest.approx(ppo.state["kl_coef"])
    with pytest.raises(ValueError, match=r"PPOModel.update: config must hold 'observed_kl'"):
        ppo.update(None, {"n_samples": 3})


def test_rank_other_than_0_steps_controller_without_writing_state():
    reward = RewardModel()
    reward.register_reward_fn(lambda p, r, b: [0.0] * len(p), name="zero")
    state = SharedState(rank=1)  # defaults: band, kl_coef 0.01, target 0.1
    ppo = PPOModel(PolicyModel(make_bigram_lm(ROWS)), reward, critic=ValueModel(TokenValueNet({})), state=state)
    ppo.update(None, {"observed_kl": 1.0, "n_samples": 2})
    assert ppo.kl_controller.value == pytest.approx(0.015) and state["kl_coef"] == 0.01


def test_state_dict_restores_the_saved_controller_kind():
    """Issue 11 defect 2: resuming with another kl_ctrl kind configured used to crash."""
    ppo = make_ppo()
    ppo.state.update({"kl_ctrl_type": "ziegler", "kl_coef": 0.1, "target_kl": 0.05})
    ppo.update(None, {"observed_kl": 0.5, "n_samples": 1000})
    sd = ppo.state_dict()
    assert sd == {"kl_controller": {"kind": "ziegler", "value": pytest.approx(0.102), "target_kl": 0.05,
                                    "horizon": 10000}}
    fresh = make_ppo()  # its SharedState says band
    assert fresh.kl_controller.name == "band"
    fresh.load_state_dict(sd)
    assert fresh.kl_controller.name == "ziegler" and fresh.kl_controller.value == pytest.approx(0.102)
    fresh.state.load_state_dict(ppo.state.state_dict())  # a resume restores SharedState too: the run goes on
    fresh.update(None, {"observed_kl": 0.5, "n_samples": 1000})
    assert fresh.state["kl_coef"] == pytest.approx(0.102 * 1.02)
    old = {"kl_controller": {"kind": "adaptive", "value": 0.3, "target_kl": 0.05, "horizon": 10000}}
    fresh.load_state_dict(old)  # a checkpoint written under the deprecated name
    assert fresh.kl_controller.name == "ziegler" and fresh.kl_controller.value == 0.3
    with pytest.raises(KeyError, match=r"unknown keys \['bogus'\]"):
        fresh.load_state_dict({"bogus": 1})


# ---- construction, components, errors ------------------------------------------------------------------------------

def test_missing_and_wrong_modules():
    ppo = make_ppo()
    with pytest.raises(MissingModuleError, match=r"^Missing required module: reward \(PPOModel was given: "
                                                 r"actor=PolicyModel, critic=ValueModel, reward=None, ref=None\)$"):
        PPOModel(ppo.actor, None, critic=ppo.critic)
    with pytest.raises(MissingModuleError, match=r"^Missing required module: critic \(algo.adv_estimator='gae' "
                                                 r"estimates advantages with a critic; the critic-free estimators "
                                                 r"are \['grpo', 'dr_grpo', 'rloo'"):
        PPOModel(ppo.actor, ppo.reward)
    with pytest.raises(TypeError, match="PPOModel: module 'critic' must be a ValueModel, got PolicyModel"):
        PPOModel(ppo.actor, ppo.reward, critic=ppo.actor)
    with pytest.raises(TypeError, match="PPOModel: module 'ref' must be a ReferenceModel, got ValueModel"):
        PPOModel(ppo.actor, ppo.reward, critic=ppo.critic, ref=ppo.critic)
    with pytest.raises(ValueError, match="unknown advantage estimator 'gea'; valid names: gae, grpo"):
        make_ppo("gea")
    with pytest.raises(ValueError, match="names has unknown role 'judge'"):
        PPOModel(ppo.actor, ppo.reward, critic=ppo.critic, names={"judge": "x"})
    with pytest.raises(ValueError, match="PPOModel.swap: unknown role 'judge'"):
        ppo.swap("judge", ppo.reward)
    PPOModel(ppo.actor, ppo.reward, critic=ppo.critic, ref=ppo.actor)  # a PolicyModel is a ReferenceModel too


def test_components_share_the_state():
    ppo = make_ppo()
    for m in (ppo.actor, ppo.critic, ppo.reward, ppo.ref):
        assert m.state is ppo.state
    assert ppo.state is ppo.actor.state  # taken from the actor when none is given


def test_missing_batch_fields_are_named():
    ppo = make_ppo(whiten_advantages=False)
    ppo.state.update({"kl_coef": 0.5, "kl_ctrl_type": "fixed"})
    b = gae_batch()
    b.values = None
    with pytest.raises(ValueError, match=r"PPOModel.compute_advantage: batch.values is missing \(None\)"):
        ppo.compute_advantage(b)
    b = gae_batch()
    b.ref_log_probs = None
    with pytest.raises(ValueError, match=r"PPOModel.compute_advantage: batch.ref_log_probs is missing"):
        ppo.compute_advantage(b)
    b.scores = None
    with pytest.raises(ValueError, match=r"PPOModel.compute_advantage: batch.scores is missing"):
        ppo.compute_advantage(b)
    b = policy_batch(RATIOS, ADVANTAGES)
    b.advantages = None
    with pytest.raises(ValueError, match=r"PPOModel.compute_policy_loss: batch.advantages is missing \(None\)"):
        ppo.compute_policy_loss(b)
    b = value_batch()
    b.returns = None
    with pytest.raises(ValueError, match=r"PPOModel.compute_value_loss: batch.returns is missing"):
        ppo.compute_value_loss(b)


def test_hot_swap_through_registry():
    ppo = make_ppo()
    reg = ModelRegistry()
    reg.register("actor", ppo.actor, aliases=("policy",))
    p2 = PPOModel(ppo.actor, ppo.reward, critic=ppo.critic, ref=ppo.ref, registry=reg)
    assert p2.registry is reg and reg.get("reward") is ppo.reward
    assert reg.version("actor") == 1  # already registered there: not bumped
    new = RewardModel()
    new.register_reward_fn(lambda p, r, x: [7.0] * len(p), name="seven")
    assert reg.register("reward", new) == 2
    assert p2.reward is new and new.state is not p2.state  # registered behind PPOModel's back: not adopted
    p2.reward = ppo.reward  # attribute assignment is a swap
    assert reg.get("reward") is ppo.reward and reg.version("reward") == 3
    p2.reward = new
    assert new.state is p2.state
    b = batch_of([[4, 5], [6, EOS]])
    scores, _ = p2.reward.compute_rewards(b, ["", ""], ["", ""])
    assert scores.sum().item() == 14.0
    with pytest.raises(TypeError, match="module 'reward' must be a RewardModel, got ValueModel"):
        p2.swap("reward", ppo.critic)
    reg.register("critic", new)  # a wrong kind slipped in through the registry is caught at use
    with pytest.raises(TypeError, match=r"registry entry 'critic' \(critic\) must be a ValueModel, got RewardModel"):
        p2.critic
    named = PPOModel(ppo.actor, ppo.reward, critic=ppo.critic, registry=ModelRegistry(),
                     names={"actor": "ppo_actor"})
    assert named.registry.get("ppo_actor") is ppo.actor and named.registry.get("actor", None) is None
