"""PPOModel: the KL controller (band and ziegler hand steps, rebuild on hot changes, clamping, rank > 0 does not
write), state_dict restoring the saved controller kind (issue 11 defect 2), missing modules and batch fields named,
components sharing the SharedState, hot swap through the registry."""
import pytest

from verl_ds.models import MissingModuleError, PolicyModel, PPOModel, RewardModel, ValueModel
from verl_ds.registry import ModelRegistry
from verl_ds.state import SharedState

from models_testutil import EOS, TokenValueNet, make_bigram_lm
from ppo_testutil import ADVANTAGES, RATIOS, ROWS, batch_of, gae_batch, make_ppo, policy_batch, value_batch


# ---- the KL controller ---------------------------------------------------------------------------------------------

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
    with pytest.raises(ValueError, match=r"unknown KL controller kind 'adaptive'; valid kinds: fixed, ziegler, band"):
        fresh.load_state_dict(old)  # a pre-0.x name: refused by name, the controller unchanged
    assert fresh.kl_controller.name == "ziegler" and fresh.kl_controller.value == pytest.approx(0.102 * 1.02)
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


def test_an_actor_of_the_wrong_kind_is_named_after_the_missing_modules():
    """Issue 30 item 8: a bare nn.Module as the actor used to fail on its missing ``.state``."""
    import torch

    ppo = make_ppo()
    with pytest.raises(MissingModuleError, match=r"^Missing required module: reward \(PPOModel was given: "
                                                 r"actor=Linear, critic=None, reward=None, ref=None\)$"):
        PPOModel(actor=torch.nn.Linear(2, 2), reward=None)
    with pytest.raises(TypeError, match=r"^PPOModel: module 'actor' must be a PolicyModel, got Linear$"):
        PPOModel(actor=torch.nn.Linear(2, 2), reward=ppo.reward, critic=ppo.critic)
    with pytest.raises(TypeError, match=r"^PPOModel: module 'actor' must be a PolicyModel, got ValueModel$"):
        PPOModel(actor=ppo.critic, reward=ppo.reward, critic=ppo.critic)


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


def test_a_plain_dict_batch_is_accepted_and_a_wrong_type_is_named():
    """Issue 11 defect 7: the design's contracts take Dict[str, Tensor]; a mapping is validated into a RolloutBatch
    (the advantages are written back into it), anything else names the type expected."""
    ppo = make_ppo(kl_coef=0.5)
    mapping = {name: tensor for name, tensor in gae_batch().items()}
    ppo.compute_advantage(mapping)
    assert {"token_rewards", "advantages", "returns"} <= set(mapping)
    loss, _ = ppo.compute_policy_loss(mapping)
    assert loss.requires_grad
    with pytest.raises(TypeError, match=r"must be a RolloutBatch or a mapping of field name -> tensor .* got list"):
        ppo.compute_policy_loss([mapping])
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['advantage_typo'\]"):
        ppo.compute_policy_loss(dict(mapping, advantage_typo=mapping["scores"]))
