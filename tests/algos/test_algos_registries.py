"""Registries of verl_ds.algos: advantage estimators, KL estimators, loss aggregation, KL controllers."""

import pytest
import torch

from verl_ds.algos import (
    ADV_ESTIMATOR_NAMES,
    KL_CTRL_KINDS,
    KL_KINDS,
    LOSS_AGG_MODES,
    BandKLController,
    ZieglerKLController,
    agg_loss,
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_advantage_estimator,
    kl_penalty,
    make_kl_controller,
    policy_loss,
    register_advantage_estimator,
    register_kl_controller,
    register_kl_estimator,
    register_loss_agg,
)
from verl_ds.algos.advantages import ADVANTAGE_ESTIMATORS
from verl_ds.algos.kl import KL_ESTIMATORS
from verl_ds.algos.kl_ctrl import KL_CONTROLLERS, FixedKLController
from verl_ds.algos.masked import LOSS_AGGREGATIONS
from verl_ds.algos.registry import Registry


# --- the generic registry --------------------------------------------------------------------------

def test_registry_aliases_duplicates_unknown_and_views():
    reg = Registry("widget", "widgets")
    view = reg.view()

    @reg.register("alpha", aliases=("a",), colour="red")
    def alpha():
        return 1

    reg.register("beta")(len)
    assert reg.get("a") is alpha and reg.entry("alpha").meta == {"colour": "red"}
    assert view == ("alpha", "a", "beta") and "a" in view and list(view) == ["alpha", "a", "beta"]
    assert reg.names(aliases=False) == ("alpha", "beta")
    with pytest.raises(ValueError, match=r"widget 'a' is already registered \(.*alpha\)"):
        reg.register("a")(len)
    with pytest.raises(ValueError, match=r"unknown widget 'alpah'; valid widgets: alpha, a, beta; did you mean "
                                         r"'alpha'\?"):
        reg.get("alpah")
    with pytest.raises(ValueError, match="unknown widget None; valid widgets"):
        reg.get(None)
    reg.unregister("alpha")
    assert view == ("beta",) and "a" not in view  # the view is live


# --- advantage estimators --------------------------------------------------------------------------

def test_advantage_estimator_names_and_flags():
    assert tuple(ADV_ESTIMATOR_NAMES) == ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                          "reinforce_plus_plus_baseline", "remax")
    flags = {n: (e.needs_critic, e.needs_groups, e.needs_baseline)
             for n in ADV_ESTIMATOR_NAMES for e in [get_advantage_estimator(n)]}
    assert flags == {"gae": (True, False, False), "grpo": (False, True, False), "dr_grpo": (False, True, False),
                     "rloo": (False, True, False), "reinforce_plus_plus": (False, False, False),
                     "reinforce_plus_plus_baseline": (False, True, False), "remax": (False, False, True)}
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gpro'; valid names: gae, grpo, dr_grpo, "
                                         r"rloo, .*did you mean 'grpo'"):
        get_advantage_estimator("gpro")


def test_uniform_call_matches_the_functions():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.2
    mask[:, 0] = True
    values, base, ids = torch.randn(6, 5, generator=g), torch.randn(6, generator=g), [0, 0, 1, 1, 2, 2]
    kw = dict(values=values, group_index=ids, baseline_scores=base, gamma=0.9, lam=0.8)  # all given: extras ignored
    gae_adv, gae_ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    expected = {
        "gae": (gae_adv * mask, gae_ret * mask),  # masked: zero off-response like every entry
        "grpo": compute_grpo_advantage(rewards, mask, ids),
        "dr_grpo": compute_grpo_advantage(rewards, mask, ids, norm_by_std=False),
        "rloo": compute_rloo_advantage(rewards, mask, ids),
        "reinforce_plus_plus": compute_reinforce_pp_advantage(rewards, mask, 0.9),
        "reinforce_plus_plus_baseline": compute_reinforce_pp_baseline_advantage(rewards, mask, ids),
        "remax": compute_remax_advantage(rewards, mask, base),
    }
    for name, (adv, ret) in expected.items():
        got_adv, got_ret = get_advantage_estimator(name)(rewards, mask, **kw)
        torch.testing.assert_close(got_adv, adv, msg=name)
        torch.testing.assert_close(got_ret, ret, msg=name)
        assert (got_adv[~mask] == 0).all() and (got_ret[~mask] == 0).all(), name


@pytest.mark.parametrize("name,missing", [("gae", "values"), ("grpo", "group_index"), ("rloo", "group_index"),
                                          ("reinforce_plus_plus_baseline", "group_index"),
                                          ("remax", "baseline_scores")])
def test_missing_inputs_are_named(name, missing):
    r, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=f"advantage estimator '{name}' needs {missing}"):
        get_advantage_estimator(name)(r, m)


def test_register_a_custom_estimator():
    @register_advantage_estimator("test_sign", needs_groups=True)
    def sign(token_rewards, response_mask, *, group_index, **_):
        adv = torch.sign(token_rewards) * response_mask
        return adv, adv

    try:
        est = get_advantage_estimator("test_sign")
        assert est.needs_groups and not est.needs_critic and "test_sign" in ADV_ESTIMATOR_NAMES
        adv, _ = est(torch.tensor([[-2.0, 3.0]]), torch.tensor([[True, False]]), group_index=[0])
        assert adv.tolist() == [[-1.0, 0.0]]
        with pytest.raises(ValueError, match="advantage estimator 'test_sign' is already registered"):
            register_advantage_estimator("test_sign")(sign)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_sign")
    assert "test_sign" not in ADV_ESTIMATOR_NAMES


# --- KL estimators, loss aggregation ---------------------------------------------------------------

def test_kl_kinds_view_and_custom_estimator():
    assert tuple(KL_KINDS) == ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "symmetric", "full_symmetric")

    @register_kl_estimator("test_sq", aliases=("test_square",))
    def sq(log_probs, ref_log_probs):
        return (log_probs - ref_log_probs) ** 2

    try:
        assert "test_square" in KL_KINDS
        out = kl_penalty(torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([0.0, 1.0]), "test_square")
        assert out.dtype == torch.float32 and out.tolist() == [1.0, 9.0]
        with pytest.raises(ValueError, match="KL kind 'k1' is already registered"):
            register_kl_estimator("k1")(sq)
    finally:
        KL_ESTIMATORS.unregister("test_sq")
    with pytest.raises(ValueError, match=r"unknown KL kind 'k33'; valid kinds: .*; did you mean 'k3'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k33")


def test_loss_agg_view_and_custom_mode():
    assert tuple(LOSS_AGG_MODES) == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                     "seq-mean-token-sum-norm")

    @register_loss_agg("test-max")
    def token_max(loss_mat, response_mask, normalizer, max_len):
        return loss_mat.max()  # loss_mat arrives with zeros outside the mask

    try:
        x = torch.tensor([[1.0, 9.0], [3.0, float("nan")]])
        m = torch.tensor([[True, False], [True, False]])
        assert agg_loss(x, m, "test-max").item() == 3.0
        lp = torch.zeros(2, 2)
        loss, _ = policy_loss(lp, lp, torch.tensor([[-1.0, 0.0], [-4.0, 0.0]]), m, loss_agg_mode="test-max")
        assert loss.item() == 4.0  # on-policy: per-token loss -A, the max over valid tokens
    finally:
        LOSS_AGGREGATIONS.unregister("test-max")
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'token_mean'; valid modes: .*did you mean "
                                         r"'token-mean'"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token_mean")


# --- KL controllers --------------------------------------------------------------------------------

def test_kl_controller_names():
    assert tuple(KL_CTRL_KINDS) == ("fixed", "ziegler", "band")
    for name, cls in (("band", BandKLController), ("ziegler", ZieglerKLController)):
        assert type(make_kl_controller(name, 0.1, 0.05)) is cls
    with pytest.raises(ValueError, match=r"unknown KL controller kind 'adaptive'; valid kinds: fixed, ziegler, band"):
        make_kl_controller("adaptive", 0.1, 0.05)  # the pre-0.x names are gone


def test_register_a_custom_kl_controller():
    @register_kl_controller("test_halving")
    class Halving(FixedKLController):  # its name comes from the registration, not from FixedKLController
        def update(self, current_kl, n_samples=None):
            self.value *= 0.5
            return self.value

    try:
        ctrl = make_kl_controller("test_halving", 0.4)
        assert ctrl.name == "test_halving" and FixedKLController.name == "fixed"
        assert ctrl.update(1.0, 8) == 0.2 and ctrl.state_dict() == {"kind": "test_halving", "value": 0.2}
        with pytest.raises(TypeError, match="unexpected arguments for the 'test_halving' KL controller: up"):
            make_kl_controller("test_halving", 0.4, up=2.0)
    finally:
        KL_CONTROLLERS.unregister("test_halving")
