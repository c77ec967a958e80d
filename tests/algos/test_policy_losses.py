"""verl_ds.algos.policy_losses: every registered policy loss against a float64 loop written here from the papers'
formulas (loss, metrics and torch.autograd gradients), against verl 0.9.1's own functions (a JSON fixture written by
tests/fixtures/make_verl_policy_losses.py: verl's import needs ray and more, too much for the test extras), against
cases worked by hand; awkward inputs (one token, all-padding rows, NaN padding, bf16, extreme ratios); the config
gate; a short end-to-end run per loss."""
import json
import math
import os

import pytest
import torch

from verl_ds.algos import (POLICY_LOSS_NAMES, PolicyLossParams, get_policy_loss, policy_loss,
                           resolve_policy_loss_agg_mode)

LOSSES = ("vanilla", "gspo", "geo_mean", "cispo", "sapo")
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
FORCED = {"geo_mean": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "verl_policy_losses.json")


def _modes(name):
    return (FORCED[name],) if name in FORCED else MODES


# ---- the float64 reference: one token (or one sequence) at a time, from the formulas --------------------------------

def reference(name, lp, old, adv, mask, p: PolicyLossParams, mode, w=None):
    """(loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}) in float64; ``lp`` may require grad (the loop is autograd's)."""
    b, t = lp.shape
    valid = [[bool(mask[i, j]) for j in range(t)] for i in range(b)]
    rows = [i for i in range(b) if any(valid[i])]
    toks = [(i, j) for i in rows for j in range(t) if valid[i][j]]
    weight = (lambda i, j: 1.0) if w is None else (lambda i, j: float(w[i, j]))
    per_tok, clip, lower, kl = {}, 0, 0, 0.0
    seq_losses = {}
    for i in rows:
        js = [j for j in range(t) if valid[i][j]]
        if name == "gspo":  # s_i from the whole sequence; its token form s_i,t = sg[s_i] pi / sg[pi]
            s_log = sum(float(lp[i, j].detach() - old[i, j]) for j in js) / len(js)
        if name == "geo_mean":
            log_sum, adv_sum, log_w = 0.0, 0.0, 0.0
        for j in js:
            a = float(adv[i, j])
            raw = lp[i, j] - old[i, j]
            x = raw.clamp(-20.0, 20.0)
            kl += -float((raw if name == "gspo" else x).detach())
            if name == "vanilla":
                r = x.exp()
                l1, l2 = -a * r, -a * r.clamp(1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
                clip += bool(l2 > l1)
                loss = torch.maximum(l1, l2)
                if a < 0 and p.clip_ratio_c is not None and bool(loss > -a * p.clip_ratio_c):
                    lower += 1
                    loss = loss * 0 + (-a * p.clip_ratio_c)
                per_tok[i, j] = loss * weight(i, j)
            elif name == "gspo":
                r = (s_log + lp[i, j] - lp[i, j].detach()).clamp(max=10.0).exp()
                l1, l2 = -a * r, -a * r.clamp(1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
                clip += bool(l2 > l1)
                per_tok[i, j] = torch.maximum(l1, l2) * weight(i, j)
            elif name == "geo_mean":  # pessimistic side of the log-space clip: min for A > 0, max for A < 0
                xc = x.clamp(-p.clip_ratio_low, p.clip_ratio_high)
                if bool(x != xc):
                    clip, lower = clip + (a > 0), lower + (a < 0)
                log_sum = log_sum + (torch.minimum(x, xc) if a > 0 else torch.maximum(x, xc) if a < 0 else 0 * x)
                adv_sum += a
                log_w += math.log(weight(i, j) + 1e-10)
            elif name == "cispo":
                r = x.exp()
                rc = float(r.detach().clamp(1 - p.clip_ratio_low, 1 + p.clip_ratio_high))
                clip += bool(float(r.detach()) != rc)
                per_tok[i, j] = -rc * a * lp[i, j] * weight(i, j)
            elif name == "sapo":
                tau = p.tau_pos if a > 0 else p.tau_neg
                per_tok[i, j] = -torch.sigmoid(tau * (x.exp() - 1)) * (4 / tau) * a * weight(i, j)
        if name == "geo_mean":
            n = len(js)
            seq_losses[i] = -(adv_sum / n) * (log_sum / n).exp() * (math.exp(log_w / n) if w is not None else 1.0)
    zero = lp.sum() * 0
    n_seq = max(len(rows), 1)
    if name == "geo_mean":
        loss = sum(seq_losses.values(), zero) / n_seq
    elif mode == "token-mean":
        loss = sum(per_tok.values(), zero) / max(len(toks), 1)
    elif mode == "seq-mean-token-mean":
        loss = sum((sum((per_tok[i, j] for j in range(t) if valid[i][j]), zero) / sum(valid[i]) for i in rows),
                   zero) / n_seq
    elif mode == "seq-mean-token-sum":
        loss = sum(per_tok.values(), zero) / n_seq
    else:
        loss = sum(per_tok.values(), zero) / (n_seq * t)
    n_tok = max(len(toks), 1)
    return loss, {"pg_clipfrac": clip / n_tok, "pg_clipfrac_lower": lower / n_tok, "ppo_kl": kl / n_tok}


def _inputs(b, t, seed, scale=0.3, ragged=True, weights=False):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5 - 2.0
    lp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    adv[0, 0] = 0.0  # a zero advantage: sign 0 for geo_mean, tau_neg for sapo
    mask = torch.ones(b, t, dtype=torch.bool)
    if ragged and b >= 3:
        mask[-1] = False  # all padding
        mask[1, 1:] = False  # one token
        if t > 3:
            mask[2, 1:3] = False  # a masked span (a tool's answer) inside the response
    w = None
    if weights:
        w = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
        w[0, -1] = 0.0  # left out by a mismatch mask
    return lp, old, adv, mask, w


def _ours(name, lp, old, adv, mask, p, mode, w=None, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(lp, old, adv, mask, p, mode, is_weights=w, **kw)
    loss.backward()
    return loss, metrics, lp.grad


def _ref_with_grad(name, lp, old, adv, mask, p, mode, w=None):
    lp = lp.detach().clone().requires_grad_(True)
    loss, metrics = reference(name, lp, old, adv, mask, p, mode, w)
    loss.backward()
    return loss, metrics, lp.grad


PARAMS = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05)


@pytest.mark.parametrize("name, mode", [(n, m) for n in LOSSES for m in _modes(n)])
@pytest.mark.parametrize("shape, weights, params", [
    ((5, 7), False, PARAMS),
    ((5, 7), True, PARAMS),
    ((3, 1), False, PARAMS),  # T = 1
    ((4, 6), False, PolicyLossParams(3e-4, 4e-4, None, 0.5, 2.0)),  # GSPO's clip, no dual clip, other taus
])
def test_each_loss_against_the_float64_loop(name, mode, shape, weights, params):
    lp, old, adv, mask, w = _inputs(*shape, seed=sum(shape), weights=weights)
    loss, metrics, grad = _ours(name, lp, old, adv, mask, params, mode, w)
    ref, ref_metrics, ref_grad = _ref_with_grad(name, lp, old, adv, mask, params, mode, w)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert grad[~mask].abs().max().item() == 0.0 if (~mask).any() else True  # padding gets no gradient
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        v = metrics[key]
        assert v.shape == () and v.dtype == torch.float32 and not v.requires_grad
        assert v.item() == pytest.approx(ref_metrics[key], abs=1e-6), key


# ---- verl's own implementation --------------------------------------------------------------------------------------

def _verl_cases():
    with open(FIXTURE, encoding="utf-8") as fh:
        data = json.load(fh)
    assert data["verl"] == "0.9.1"
    return [(c, loss, mode) for c in data["cases"] for loss, by_mode in c["results"].items() for mode in by_mode]


@pytest.mark.parametrize("case, name, mode", _verl_cases(),
                         ids=lambda x: x["name"] if isinstance(x, dict) else str(x))
def test_each_loss_against_verl(case, name, mode):
    f64 = lambda k: torch.tensor(case[k], dtype=torch.float64)  # noqa: E731
    mask = f64("response_mask").bool()
    w = None if case["is_weights"] is None else f64("is_weights")
    p = PolicyLossParams(case["clip_ratio_low"], case["clip_ratio_high"], case["clip_ratio_c"], case["tau_pos"],
                         case["tau_neg"])
    loss, metrics, grad = _ours(name, f64("log_probs"), f64("old_log_probs"), f64("advantages"), mask, p, mode, w)
    want = case["results"][name][mode]
    scale = 1.0
    if name == "geo_mean":  # verl's torch.mean also counts all-padding rows; we divide by the sequences with tokens
        scale = mask.shape[0] / max(int(mask.any(dim=1).sum()), 1)
    assert loss.item() == pytest.approx(want["loss"] * scale, rel=2e-5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor(want["grad"], dtype=torch.float64) * scale, rtol=1e-4, atol=1e-6)
    for key, value in want["metrics"].items():
        assert metrics[key].item() == pytest.approx(value, abs=1e-6), key


# ---- worked by hand -------------------------------------------------------------------------------------------------

L2 = math.log(2.0)


def test_hand_computed_cases():
    one = torch.ones(1, 2, dtype=torch.bool)
    p = PolicyLossParams(0.2, 0.2, 3.0)
    # one sequence, log-ratios (ln 2, 0), A = 1: vanilla clips the first token: (-1.2 - 1) / 2 = -1.1
    lp, old, adv = torch.tensor([[L2 - 1.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
    assert get_policy_loss("vanilla")(lp, old, adv, one, p, "token-mean")[0].item() == pytest.approx(-1.1)
    # gspo: s = exp(mean(ln 2, 0)) = sqrt 2 > 1.2 on both tokens: -1.2 each, clipfrac 1
    loss, m = get_policy_loss("gspo")(lp, old, adv, one, p, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.2) and m["pg_clipfrac"].item() == 1.0
    # geo_mean: ln 2 clipped to 0.2 in log space (A > 0): -exp((0.2 + 0) / 2) = -exp(0.1); one token clipped
    loss, m = get_policy_loss("geo_mean")(lp, old, adv, one, p, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-math.exp(0.1)) and m["pg_clipfrac"].item() == 0.5
    # cispo: weights sg[clip(2)] = 1.2 and 1: -(1.2 (ln 2 - 1) + 1 (-1)) / 2; d/d lp = (-0.6, -0.5)
    lp_g = lp.clone().requires_grad_(True)
    loss, m = get_policy_loss("cispo")(lp_g, old, adv, one, p, "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-(1.2 * (L2 - 1.0) - 1.0) / 2) and m["pg_clipfrac"].item() == 0.5
    torch.testing.assert_close(lp_g.grad, torch.tensor([[-0.6, -0.5]]))
    # sapo, tau 1: gate(2) = 4 sigmoid(1) and gate(1) = 4 sigmoid(0) = 2... / tau: -(4 sigmoid(1) + 2) / 2
    loss, m = get_policy_loss("sapo")(lp, old, adv, one, PolicyLossParams(tau_pos=1.0), "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(4 / (1 + math.exp(-1)) + 2) / 2)
    # the gate's slope at ratio 1 is 1, as the ratio's: d loss / d lp = -A rho / 2 on the token with ratio 1
    lp_g = lp.clone().requires_grad_(True)
    get_policy_loss("sapo")(lp_g, old, adv, one, PolicyLossParams(), "seq-mean-token-mean")[0].backward()
    assert lp_g.grad[0, 1].item() == pytest.approx(-0.5)


def test_gspo_token_gradient_is_per_token_and_clip_stops_it():
    """d loss / d lp_t = -A s / |y| for each token while s is inside the band, 0 for every token once s is out."""
    old = torch.zeros(1, 3)
    adv = torch.ones(1, 3)
    m = torch.ones(1, 3, dtype=torch.bool)
    lp = torch.tensor([[1e-4, -1e-4, 3e-4]], requires_grad=True)  # s = exp(1e-4), inside (1 - 3e-4, 1 + 4e-4)
    get_policy_loss("gspo")(lp, old, adv, m, PolicyLossParams(3e-4, 4e-4), "seq-mean-token-mean")[0].backward()
    torch.testing.assert_close(lp.grad, torch.full((1, 3), -math.exp(1e-4) / 3))
    lp = torch.tensor([[1e-3, 1e-3, 1e-3]], requires_grad=True)  # s = exp(1e-3) > 1 + 4e-4 with A > 0: clipped
    get_policy_loss("gspo")(lp, old, adv, m, PolicyLossParams(3e-4, 4e-4), "seq-mean-token-mean")[0].backward()
    assert lp.grad.abs().max().item() == 0.0


# ---- awkward inputs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LOSSES)
def test_all_padding_gives_zero_loss_zero_grad_zero_metrics(name):
    lp = torch.randn(3, 4, requires_grad=True)
    loss, metrics = get_policy_loss(name)(lp, torch.randn(3, 4), torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().max().item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("name", LOSSES)
def test_nan_in_padding_never_reaches_loss_or_grad(name):
    lp, old, adv, mask, _ = _inputs(5, 6, seed=3)
    clean, _, clean_grad = _ours(name, lp, old, adv, mask, PARAMS, FORCED.get(name, "token-mean"))
    dirty = [x.clone() for x in (lp, old, adv)]
    for x in dirty:
        x[~mask] = float("nan")
    loss, _, grad = _ours(name, *dirty, mask, PARAMS, FORCED.get(name, "token-mean"))
    assert loss.item() == clean.item()
    torch.testing.assert_close(grad, clean_grad, equal_nan=False)


@pytest.mark.parametrize("name", LOSSES)
def test_bf16_inputs(name):
    """bf16 log-probs are upcast before the ratio: the loss is float32 and equals the float32 computation on the same
    (bf16-rounded) values; the gradient reaches the bf16 tensor."""
    lp, old, adv, mask, _ = _inputs(5, 6, seed=4)
    lp16, old16, adv16 = (x.to(torch.bfloat16) for x in (lp, old, adv))
    mode = FORCED.get(name, "token-mean")
    loss, _, grad = _ours(name, lp16, old16, adv16, mask, PARAMS, mode)
    want, _, _ = _ours(name, *(x.float() for x in (lp16, old16, adv16)), mask, PARAMS, mode)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
    assert torch.isfinite(grad.float()).all()


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("log_ratio", [-1e4, -50.0, 50.0, 1e4])
def test_extreme_ratios_stay_finite(name, log_ratio):
    lp = torch.full((2, 3), -1.0)
    lp[0, 1] += log_ratio
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, 1.0]])
    for sign in (1.0, -1.0):
        loss, metrics, grad = _ours(name, lp, torch.full((2, 3), -1.0), sign * adv, torch.ones(2, 3, dtype=torch.bool),
                                    PARAMS, FORCED.get(name, "token-mean"))
        assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
        assert all(math.isfinite(v.item()) for v in metrics.values())


def test_the_old_policy_loss_call_is_vanilla():
    lp, old, adv, mask, w = _inputs(4, 5, seed=5, weights=True)
    a = policy_loss(lp, old, adv, mask, 0.1, 0.3, 2.5, "seq-mean-token-sum", is_weights=w)[0]
    b = get_policy_loss("vanilla")(lp, old, adv, mask, PolicyLossParams(0.1, 0.3, 2.5), "seq-mean-token-sum",
                                   is_weights=w)[0]
    assert a.item() == b.item()


# ---- registry, aggregation, parameters -----------------------------------------------------------------------------

def test_registry_names_and_alias():
    assert tuple(POLICY_LOSS_NAMES) == ("vanilla", "gspo", "geo_mean", "gmpo", "cispo", "sapo")
    assert get_policy_loss("gmpo") is get_policy_loss("geo_mean")
    with pytest.raises(ValueError, match="unknown policy loss 'gpso'.*vanilla, gspo, geo_mean, gmpo, cispo, sapo"
                                         ".*did you mean 'gspo'"):
        get_policy_loss("gpso")


@pytest.mark.parametrize("loss, mode, estimator, want", [
    ("vanilla", "auto", "grpo", "token-mean"),
    ("vanilla", "auto", "dr_grpo", "seq-mean-token-sum-norm"),
    ("gspo", "auto", "dr_grpo", "seq-mean-token-mean"),
    ("gspo", "token-mean", "grpo", "token-mean"),  # verl takes any mode for gspo
    ("gmpo", "auto", "grpo", "seq-mean-token-mean"),
    ("sapo", "seq-mean-token-mean", "grpo", "seq-mean-token-mean"),
    ("cispo", "auto", "grpo", "token-mean"),
])
def test_resolved_aggregation(loss, mode, estimator, want):
    assert resolve_policy_loss_agg_mode(loss, mode, estimator) == want


@pytest.mark.parametrize("name", ["geo_mean", "sapo"])
def test_a_loss_that_aggregates_per_sequence_refuses_another_mode(name):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=f"policy loss '{name}' aggregates seq-mean-token-mean.*token-mean"):
        get_policy_loss(name)(x, x, x, torch.ones(2, 3, dtype=torch.bool), PARAMS, "token-mean")
    with pytest.raises(ValueError, match="set it to auto or seq-mean-token-mean"):
        resolve_policy_loss_agg_mode(name, "seq-mean-token-sum", "grpo")


@pytest.mark.parametrize("kwargs, match", [
    ({"clip_ratio_low": 1.0}, "clip_ratio_low must be in \\[0, 1\\)"),
    ({"clip_ratio_high": -0.1}, "clip_ratio_high must be a finite number >= 0"),
    ({"clip_ratio_c": 1.0}, "clip_ratio_c must be a number > 1"),
    ({"tau_pos": 0.0}, "tau_pos must be a finite number > 0"),
    ({"tau_neg": float("inf")}, "tau_neg must be a finite number > 0"),
])
def test_bad_params_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossParams(**kwargs)


def test_bad_call_arguments_are_refused_by_name():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="params must be a PolicyLossParams, got dict"):
        get_policy_loss("gspo")(x, x, x, m, {"clip_ratio_low": 0.2})
    with pytest.raises(ValueError, match="shape mismatch: advantages has shape \\(2, 2\\)"):
        get_policy_loss("cispo")(x, x, x[:, :2], m)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        get_policy_loss("gspo")(x, x, x, m, PARAMS, "mean")


# ---- the config gate and a real run ---------------------------------------------------------------------------------

def test_config_gate_names_the_valid_losses():
    from verl_ds.config import ConfigError, describe, load_config
    from verl_ds.resolved_config import registry_choices
    from verl_ds.run.checks import check_config

    grpo = ["algo.adv_estimator=grpo", "rollout.n=4"]
    check_config(load_config(None, [*grpo, "algo.policy_loss=gmpo"]))
    names = "\\['vanilla', 'gspo', 'geo_mean', 'gmpo', 'cispo', 'sapo'\\]"
    with pytest.raises(ConfigError, match=f"algo.policy_loss: 'gpso' is not one of {names}"):
        check_config(load_config(None, [*grpo, "algo.policy_loss=gpso"]))
    with pytest.raises(ConfigError, match="algo.loss_agg_mode: policy loss 'sapo' aggregates seq-mean-token-mean"):
        check_config(load_config(None, [*grpo, "algo.policy_loss=sapo", "algo.loss_agg_mode=token-mean"]))
    text = describe(registry_choices())
    line = next(ln for ln in text.splitlines() if "algo.policy_loss" in ln)
    assert "gspo" in line and "sapo" in line


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("gspo", ["algo.clip_ratio_low=3e-4", "algo.clip_ratio_high=4e-4"]),  # the paper's band
    ("cispo", ["algo.clip_ratio_low=0.9", "algo.clip_ratio_high=0.28"]),
])
def test_a_tiny_run_trains_with_the_loss(tmp_path, name, overrides):
    from e2e_utils import read_metrics, run_train

    out = str(tmp_path / name)
    run_train(out, ["algo.adv_estimator=grpo", "rollout.n=4", f"algo.policy_loss={name}", "trainer.total_steps=3",
                    "trainer.export=none", "trainer.val_every=0", "trainer.save_every=0", *overrides], timeout=300)
    steps = [m for m in read_metrics(out) if "actor/pg_loss" in m]
    assert len(steps) == 3
    for m in steps:
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                    "actor/grad_norm"):
            assert math.isfinite(m[key]), (key, m)
        assert m["actor/grad_norm"] > 0
    # two mini-batches a step: the second is scored by the policy the first one moved
    assert any(abs(m["actor/ppo_kl"]) > 0 for m in steps)
