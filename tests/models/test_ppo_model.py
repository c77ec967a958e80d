"""PPOModel: fresh-critic GAE, KL in reward / in loss (gradient reaches the actor), hot values read at call
time, KL controller updates and rebuilds, metrics, hot swap, state_dict."""
import copy
import math

import pytest
import torch

from verl_ds.models import PolicyModel, PPOConfig, PPOModel, RewardModel, ValueModel
from verl_ds.registry import ModelRegistry
from verl_ds.state import SharedState


def gae_reference(rewards, values, mask, gamma, lam):
    """float64 loop over contiguous-prefix responses: V after the last real token is 0."""
    B, R = rewards.shape
    adv = torch.zeros(B, R, dtype=torch.float64)
    for i in range(B):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = float(values[i, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[i, t]) + gamma * nv - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv, adv + values.double() * mask


@pytest.fixture
def setup(tiny_lm, tiny_critic, make_rollout):
    state = SharedState(rank=0)
    ref_lm = copy.deepcopy(tiny_lm)
    with torch.no_grad():  # make the actor differ from the reference so the KL is not zero
        for p in tiny_lm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    actor, ref = PolicyModel(tiny_lm), PolicyModel(ref_lm)
    critic = ValueModel(tiny_critic)
    reward = RewardModel()
    reward.register_reward_fn(lambda p, r, b: [float(i) for i in range(len(p))], name="idx")
    ppo = PPOModel(actor, critic, reward, ref=ref, state=state)
    b = make_rollout(B=4, P=5, R=4)
    with torch.no_grad():
        b.logprob = actor.get_logprob(b.observation, b.action, b.mask)
        b.ref_logprob = ref.get_logprob(b.observation, b.action, b.mask)
    b.score, _ = reward.compute_rewards(b, b.extras["prompt"], [""] * 4)
    return ppo, b, state


def test_missing_and_wrong_modules(setup):
    ppo, _, _ = setup
    with pytest.raises(ValueError, match=r"^Missing required module: reward \(PPOModel was given: actor=PolicyModel, "
                                         r"critic=ValueModel, reward=None, ref=None\)$"):
        PPOModel(ppo.actor, ppo.critic, None)
    with pytest.raises(TypeError, match="PPOModel: module 'critic' must be a ValueModel, got PolicyModel"):
        PPOModel(ppo.actor, ppo.actor, ppo.reward)


def test_components_share_the_state(setup):
    ppo, _, state = setup
    assert ppo.actor.state is state and ppo.critic.state is state and ppo.reward.state is state
    assert ppo.ref.state is state


def test_compute_advantage_fresh_values_kl_in_reward_and_gae(setup):
    ppo, b, state = setup
    state.update({"kl_coef": 0.3, "gamma": 0.9, "lam": 0.8, "kl_kind": "k1"})
    b.value = torch.full_like(b.logprob, 99.0)  # stale buffer values must be ignored
    metrics = ppo.compute_advantage(b, PPOConfig(whiten_advantages=False))
    m = b.response_mask
    with torch.no_grad():
        fresh = ppo.critic.get_values(b.observation, b.mask, 4) * m
    torch.testing.assert_close(b.value, fresh)
    assert b.old_value is not None and torch.equal(b.old_value, b.value)
    kl = (b.logprob.double() - b.ref_logprob.double()) * m
    want_reward = b.score.double() - 0.3 * kl
    torch.testing.assert_close(b.reward.double(), want_reward, atol=1e-6, rtol=0)
    adv, ret = gae_reference(want_reward, fresh.double(), m, 0.9, 0.8)
    torch.testing.assert_close(b.advantage.double(), adv, atol=1e-5, rtol=0)
    torch.testing.assert_close(b["return"].double(), ret * m, atol=1e-5, rtol=0)
    for key in ("critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
                "critic/values/mean", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"):
        assert isinstance(metrics[key], float), key
    assert metrics["critic/score/mean"] == pytest.approx(1.5)  # the idx reward: 0, 1, 2, 3
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.3


def test_kl_coef_read_at_call_time_and_no_double_penalty(setup):
    ppo, b, state = setup
    b.reward, b.score = b.score, None  # the trainer may hand the scores over in batch.reward
    state.set("kl_coef", 0.0)
    ppo.compute_advantage(b)
    assert b.score is not None
    r0 = b.reward.clone()
    state.set("kl_coef", 1.0)
    ppo.compute_advantage(b)
    kl = (b.logprob - b.ref_logprob) * b.response_mask
    torch.testing.assert_close(b.reward, r0 - kl, atol=1e-6, rtol=0)
    state.set("use_kl_penalty", False)
    ppo.compute_advantage(b)
    torch.testing.assert_close(b.reward, b.score)


def test_whitening_default_and_custom(setup):
    ppo, b, _ = setup
    ppo.compute_advantage(b)
    a = b.advantage[b.response_mask].double()
    assert abs(a.mean()) < 1e-5 and a.std() == pytest.approx(1.0, abs=1e-3)
    assert (b.advantage[~b.response_mask] == 0).all()
    calls = []

    def whiten(x, mask):
        calls.append(mask.shape)
        return x * 2

    ppo.compute_advantage(b, whiten_fn=whiten)
    assert calls == [(4, 4)]


def test_policy_loss_matches_algos_and_metrics(setup):
    from verl_ds import algos

    ppo, b, state = setup
    ppo.compute_advantage(b)
    state.update({"entropy_coef": 0.0, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3})
    loss, metrics = ppo.compute_policy_loss(b)
    lp = ppo.actor.get_logprob(b.observation, b.action, b.mask)
    want, _ = algos.policy_loss(lp, b.logprob, b.advantage, b.response_mask, 0.1, 0.3, 3.0, "token-mean")
    torch.testing.assert_close(loss, want)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy"):
        assert isinstance(metrics[key], float), key
    assert "actor/kl_loss" not in metrics  # KL is in the reward by default
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # same weights as the rollout
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ppo.actor.lm.parameters())


def test_entropy_bonus(setup):
    from verl_ds import algos

    ppo, b, state = setup
    ppo.compute_advantage(b)
    base, _ = ppo.compute_policy_loss(b)
    state.set("entropy_coef", 0.1)
    with_bonus, metrics = ppo.compute_policy_loss(b)
    _, ent = ppo.actor.get_logprob(b.observation, b.action, b.mask, return_entropy=True)
    torch.testing.assert_close(with_bonus, base - 0.1 * algos.agg_loss(ent, b.response_mask, "token-mean"))
    assert metrics["actor/entropy"] > 0


def test_kl_in_loss_gradient_reaches_actor(setup):
    from verl_ds import algos

    ppo, b, state = setup
    cfg = PPOConfig(kl_in_reward=False)
    ppo.compute_advantage(b, cfg)
    b.advantage = torch.zeros_like(b.advantage)  # the surrogate contributes no gradient: only the KL term can
    state.update({"kl_coef": 0.5, "kl_kind": "k3", "entropy_coef": 0.0})
    loss, metrics = ppo.compute_policy_loss(b, cfg)
    lp = ppo.actor.get_logprob(b.observation, b.action, b.mask)
    kl_loss = algos.agg_loss(algos.kl_penalty(lp, b.ref_logprob, "k3"), b.response_mask, "token-mean")
    torch.testing.assert_close(loss, 0.5 * kl_loss, atol=1e-6, rtol=0)
    assert metrics["actor/kl_coef"] == 0.5 and metrics["actor/kl_loss"] > 0
    ppo.actor.lm.zero_grad()
    loss.backward()
    grad = sum(p.grad.abs().sum() for p in ppo.actor.lm.parameters() if p.grad is not None)
    assert grad > 0
    assert all(p.grad is None for p in ppo.ref.lm.parameters())  # the reference gets none
    state.set("kl_coef", 0.0)  # and with a zero coefficient the actor gets none either
    ppo.actor.lm.zero_grad()
    loss0, _ = ppo.compute_policy_loss(b, cfg)
    loss0.backward()
    assert sum(p.grad.abs().sum() for p in ppo.actor.lm.parameters() if p.grad is not None) == 0


def test_normalizer_is_passed_through(setup):
    ppo, b, _ = setup
    ppo.compute_advantage(b)
    n = float(b.response_mask.sum())
    loss, _ = ppo.compute_policy_loss(b)
    scaled, _ = ppo.compute_policy_loss(b, normalizer=2 * n)
    torch.testing.assert_close(scaled, loss / 2)


def test_value_loss_and_gradient(setup):
    from verl_ds import algos

    ppo, b, state = setup
    ppo.compute_advantage(b)
    state.set("cliprange_value", 0.2)
    loss, metrics = ppo.compute_value_loss(b)
    v = ppo.critic.get_values(b.observation, b.mask, 4)
    want, _ = algos.value_loss(v, b.old_value, b["return"], b.response_mask, 0.2, "token-mean")
    torch.testing.assert_close(loss, want)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var"):
        assert isinstance(metrics[key], float), key
    loss.backward()
    assert ppo.critic.net.value_head.weight.grad.abs().sum() > 0


def test_missing_batch_fields(setup):
    ppo, b, _ = setup
    b.advantage = None
    with pytest.raises(ValueError, match=r"PPOModel.compute_policy_loss: batch.advantage is missing"):
        ppo.compute_policy_loss(b)
    b.score = b.reward = None
    with pytest.raises(ValueError, match=r"batch.score is missing: set it to the token scores"):
        ppo.compute_advantage(b)


def test_update_adaptive_controller_writes_kl_coef(setup):
    ppo, b, state = setup
    state.update({"kl_ctrl_type": "adaptive", "kl_coef": 0.1, "target_kl": 0.05})
    ppo.update(b, observed_kl=0.5, n_samples=1000)  # error clipped to +0.2
    assert state["kl_coef"] == pytest.approx(0.1 * (1 + 0.2 * 1000 / 10000))
    assert ppo.kl_controller.value == pytest.approx(state["kl_coef"])


def test_update_measures_kl_from_batch(setup):
    from verl_ds import algos

    ppo, b, state = setup
    state.update({"kl_ctrl_type": "adaptive", "kl_coef": 0.1, "target_kl": 1.0})
    observed = float(algos.masked_mean(b.logprob - b.ref_logprob, b.response_mask))
    ppo.update(b)
    err = max(-0.2, min(0.2, observed / 1.0 - 1))
    assert state["kl_coef"] == pytest.approx(0.1 * (1 + err * 4 / 10000))


def test_multiplicative_rule_and_controller_rebuild(setup):
    ppo, b, state = setup
    state.update({"kl_ctrl_type": "multiplicative", "kl_coef": 0.2, "target_kl": 0.1})
    ppo.update(b, observed_kl=0.2)  # > 1.5 * target
    assert state["kl_coef"] == pytest.approx(0.3)
    ppo.update(b, observed_kl=0.01)  # < 0.5 * target
    assert state["kl_coef"] == pytest.approx(0.24)
    ppo.update(b, observed_kl=0.1)  # inside the band
    assert state["kl_coef"] == pytest.approx(0.24)
    state.set("kl_ctrl_type", "fixed")
    ppo.update(b, observed_kl=5.0)
    assert state["kl_coef"] == pytest.approx(0.24)
    state.set("kl_coef", 0.7)  # a hot update of the coefficient itself is adopted
    state.set("kl_ctrl_type", "multiplicative")
    ppo.update(b, observed_kl=1.0)
    assert state["kl_coef"] == pytest.approx(1.05)


def test_state_dict_roundtrip_restores_controller(setup):
    ppo, b, state = setup
    state.update({"kl_ctrl_type": "adaptive", "kl_coef": 0.1, "target_kl": 0.05})
    ppo.update(b, observed_kl=0.5, n_samples=1000)
    sd = ppo.state_dict()
    assert sd["kl_controller_type"] == "adaptive" and sd["config"]["loss_agg_mode"] == "token-mean"
    fresh = PPOModel(ppo.actor, ppo.critic, ppo.reward, state=SharedState(rank=0))
    fresh.load_state_dict(sd)
    assert fresh.kl_controller.value == pytest.approx(ppo.kl_controller.value)
    with pytest.raises(KeyError, match="unknown keys"):
        fresh.load_state_dict({"bogus": 1})


def test_hot_swap_reward_through_registry(setup):
    ppo, b, _ = setup
    reg = ModelRegistry()
    reg.register("actor", ppo.actor, aliases=("policy",))
    p2 = PPOModel(ppo.actor, ppo.critic, ppo.reward, ref=ppo.ref, registry=reg)
    assert reg.get("reward") is ppo.reward
    assert reg.version("actor") == 1  # already registered there: not bumped
    new = RewardModel()
    new.register_reward_fn(lambda p, r, x: [7.0] * len(p), name="seven")
    assert reg.register("reward", new) == 2
    assert p2.reward is new
    p2.reward = ppo.reward  # attribute assignment is a swap too
    assert reg.get("reward") is ppo.reward and reg.version("reward") == 3
    p2.reward = new
    scores, _ = p2.reward.compute_rewards(b, [""] * 4, [""] * 4)
    assert scores.sum().item() == 28.0
    with pytest.raises(TypeError, match="module 'reward' must be a RewardModel, got ValueModel"):
        p2.swap("reward", ppo.critic)
    reg.register("critic", new)  # a wrong kind slipped in through the registry is caught at use
    with pytest.raises(TypeError, match=r"registry entry 'critic' \(critic\) must be a ValueModel, got RewardModel"):
        p2.critic


def test_config_validation():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PPOConfig(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match=r"PPOConfig: unknown keys \['kl_coef'\]"):
        from verl_ds.models.ppo import _as_config
        _as_config({"kl_coef": 0.1}, PPOConfig())
    assert math.isfinite(PPOConfig().clip_ratio_c)


def test_more_ppo_messages(setup):
    ppo, b, state = setup
    with pytest.raises(TypeError, match="PPOConfig.kl_in_reward must be a bool, got 1"):
        PPOConfig(kl_in_reward=1)
    with pytest.raises(ValueError, match="PPOConfig.kl_horizon must be an int >= 1"):
        PPOConfig(kl_horizon=0)
    with pytest.raises(TypeError, match="config must be a PPOConfig, a dict or None, got str"):
        ppo.compute_advantage(b, "fast")
    with pytest.raises(ValueError, match="names has unknown role 'judge'"):
        PPOModel(ppo.actor, ppo.critic, ppo.reward, names={"judge": "x"})
    with pytest.raises(ValueError, match="PPOModel.swap: unknown role 'judge'"):
        ppo.swap("judge", ppo.reward)
    state.set("kl_ctrl_type", "adaptive")
    b.ref_logprob = None
    with pytest.raises(ValueError, match="batch.logprob and batch.ref_logprob are needed to measure the KL"):
        ppo.update(b)
    state.set("kl_ctrl_type", "fixed")
    ppo.update(b)  # a fixed coefficient needs no measurement
    cfg = ppo.compute_advantage(b, {"kl_in_reward": False, "whiten_advantages": False})
    assert "actor/reward_kl_penalty" not in cfg
