"""Rollout-mismatch correction (verl_ds.algos.mismatch): every is_mode against a float64 loop written from the
formulas, verl 0.9.1's rollout correction on fixed inputs (tests/fixtures/mismatch_verl.json, written by
tests/fixtures/make_mismatch_fixture.py), hand-computed cases, today's two weight functions bit for bit, awkward
inputs (fully masked rows, one token, bf16, extreme log-ratios), the refusals, and PPOModel's loss with each."""
import json
import math
import os

import pytest
import torch

from verl_ds.algos import agg_loss
from verl_ds.algos.mismatch import (IS_MODES, REJECTION_CRITERIA, decoupled_is_weights, mismatch_weights,
                                    parse_rejection, truncated_is_weights)
from verl_ds.config import ConfigError, load_config
from verl_ds.models import PPOModel
from verl_ds.run.checks import check_config

from ppo_testutil import ADVANTAGES, RATIOS, make_ppo, policy_batch, t

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "mismatch_verl.json")
# mode -> (level, outside the band), spelled out here from the docs, not read from the module
MODES = {"truncate": ("token", "truncate"), "token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
         "sequence_truncate": ("sequence", "truncate"), "sequence_mask": ("sequence", "mask"),
         "geo_mask": ("geo", "filter"), "decoupled": ("token", "mask")}


def loop_weights(old, rollout, mask, mode, cap, low):
    """float64, row by row: rho per token, exp(sum) or exp(mean) of the row's log-ratios (each clamped to +-20),
    then min(rho, cap), rho inside [low, cap] else 0, or 1 inside else 0."""
    level, action = MODES[mode]
    out = []
    for o_row, r_row, m_row in zip(old, rollout, mask):
        lrs = [o - r for o, r, m in zip(o_row, r_row, m_row) if m]
        total = sum(lrs)
        row_lr = total if level == "sequence" else total / max(len(lrs), 1)
        row = []
        for o, r, m in zip(o_row, r_row, m_row):
            if not m:
                row.append(0.0)
                continue
            lr = o - r if level == "token" else row_lr
            rho = math.exp(min(max(lr, -20.0), 20.0))
            inside = low <= rho <= cap
            row.append(min(rho, cap) if action == "truncate" else (rho if action == "mask" else 1.0) * inside)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def random_case(seed, B=6, R=7, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    rollout = old - torch.randn(B, R, generator=g, dtype=torch.float64) * spread
    mask = torch.rand(B, R, generator=g) > 0.25
    mask[0] = False  # a fully masked row
    mask[1, 1:] = False  # a one-token row
    return old, rollout, mask


@pytest.mark.parametrize("mode,cap,low", [(mode, cap, low) for mode in MODES for cap, low in ((2.0, 0.0), (1.3, 0.6),
                                                                                              (1.0, 0.0))
                                           if not (low > 0 and MODES[mode][1] == "truncate")])  # refused: see below
def test_every_mode_matches_a_float64_loop(mode, cap, low):
    for seed in range(3):
        old, rollout, mask = random_case(seed)
        w, metrics = mismatch_weights(old.float(), rollout.float(), mask, mode, cap, low)
        ref = loop_weights(old.float().double().tolist(), rollout.float().double().tolist(), mask.tolist(), mode,
                           cap, low)
        assert w.dtype == torch.float32 and not w.requires_grad
        torch.testing.assert_close(w.double(), ref, rtol=1e-5, atol=1e-7)
        n = mask.sum().item()
        assert float(metrics["is_weight_mean"]) == pytest.approx(float(ref.sum()) / n, rel=1e-5)
        assert float(metrics["is_masked_frac"]) == pytest.approx(float(((ref == 0) & mask).sum()) / n)
        rows = mask.any(-1)
        masked_rows = ((ref == 0) & mask).any(-1)
        assert float(metrics["is_seq_masked_frac"]) == pytest.approx(float((masked_rows & rows).sum() / rows.sum()))


def test_mismatch_metrics_match_a_float64_loop():
    old, rollout, mask = random_case(5, spread=0.3)
    _, metrics = mismatch_weights(old.float(), rollout.float(), mask, None)
    o, r, valid = old.float().double().tolist(), rollout.float().double().tolist(), mask.tolist()
    cells = [(b, i) for b in range(len(o)) for i in range(len(o[b])) if valid[b][i]]
    k1 = [r[b][i] - o[b][i] for b, i in cells]
    k3 = [math.exp(o[b][i] - r[b][i]) - 1 - (o[b][i] - r[b][i]) for b, i in cells]
    ratios = [math.exp(-x) for x in k1]
    seq = [sum(r[b][i] - o[b][i] for i in range(len(o[b])) if valid[b][i]) for b in range(len(o)) if any(valid[b])]
    assert float(metrics["mismatch_k1"]) == pytest.approx(sum(k1) / len(k1), abs=1e-6)
    assert float(metrics["mismatch_k3"]) == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    assert float(metrics["mismatch_seq_k1"]) == pytest.approx(sum(seq) / len(seq), abs=1e-6)
    assert float(metrics["is_ratio_min"]) == pytest.approx(min(ratios), rel=1e-5)
    assert float(metrics["is_ratio_max"]) == pytest.approx(max(ratios), rel=1e-5)
    assert float(metrics["is_ratio_mean"]) == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert float(metrics["is_weight_mean"]) == 1.0 and float(metrics["is_masked_frac"]) == 0.0
    assert "is_capped_frac" not in metrics  # no importance weights, no cap


def test_today_s_truncate_and_decoupled_give_the_same_weights_bit_for_bit():
    """The weights of rollout.is_mode=truncate / decoupled before the modes were widened, written out here."""
    old, rollout, mask = random_case(7, spread=1.0)
    old, rollout = old.float(), rollout.float()
    ratio = torch.exp(torch.where(mask, old - rollout, 0.0).clamp(-20.0, 20.0))
    for cap in (1.0, 1.5, 2.0, 3.0):
        truncated = torch.where(mask, ratio.clamp(max=cap), 0.0)
        decoupled = torch.where(mask & ~(ratio > cap), ratio, 0.0)
        for fn, mode, want in ((truncated_is_weights, "truncate", truncated),
                               (decoupled_is_weights, "decoupled", decoupled)):
            for w, m in (fn(old, rollout, mask, cap), mismatch_weights(old, rollout, mask, mode, cap)):
                assert torch.equal(w, want)
                assert torch.equal(m["is_capped_frac"], (ratio > cap)[mask].float().mean())
        assert torch.equal(mismatch_weights(old, rollout, mask, "token_truncate", cap)[0], truncated)
        assert torch.equal(mismatch_weights(old, rollout, mask, "token_mask", cap)[0], decoupled)


def test_hand_computed_row():
    """One row, trainer / sampler ratios 1, 3, 0.5 (product 1.5, geometric mean 1.5^(1/3) = 1.1447):
    token_truncate cap 2: 1, 2, 0.5; token_mask [0.6, 2]: 1, 0, 0; sequence_truncate cap 2: 1.5 each, cap 1.2: 1.2
    each; sequence_mask cap 1.2: 0; geo_mask [0.9, 1.2]: 1 each, [0.9, 1.1]: 0."""
    old = torch.log(torch.tensor([[0.5, 0.6, 0.1]]))
    rollout = old - torch.log(torch.tensor([[1.0, 3.0, 0.5]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    cases = [("token_truncate", 2.0, 0.0, [1.0, 2.0, 0.5]), ("token_mask", 2.0, 0.6, [1.0, 0.0, 0.0]),
             ("sequence_truncate", 2.0, 0.0, [1.5] * 3), ("sequence_truncate", 1.2, 0.0, [1.2] * 3),
             ("sequence_mask", 1.2, 0.0, [0.0] * 3), ("sequence_mask", 2.0, 0.0, [1.5] * 3),
             ("geo_mask", 1.2, 0.9, [1.0] * 3), ("geo_mask", 1.1, 0.9, [0.0] * 3)]
    for mode, cap, low, want in cases:
        w, _ = mismatch_weights(old, rollout, mask, mode, cap, low)
        torch.testing.assert_close(w, torch.tensor([want]), rtol=1e-6, atol=1e-7, msg=f"{mode} {cap} {low}")
    # rejection: k3 = rho - 1 - log rho is 0, 0.901, 0.193; token_k3:0.5 leaves out the second token
    w, m = mismatch_weights(old, rollout, mask, None, rejection="token_k3:0.5")
    assert w.tolist() == [[1.0, 0.0, 1.0]] and float(m["is_masked_frac"]) == pytest.approx(1 / 3)
    assert float(m["is_seq_masked_frac"]) == 1.0
    # seq_sum_k1 sums log(pi_sampler / pi_train) = -log 1.5 = -0.405: kept inside [1/2, 2], left out of [0.8, 2]
    assert mismatch_weights(old, rollout, mask, None, rejection="seq_sum_k1:2")[0].tolist() == [[1.0] * 3]
    assert mismatch_weights(old, rollout, mask, None, rejection="seq_sum_k1:0.8_2")[0].tolist() == [[0.0] * 3]


def _fixture():
    with open(FIXTURE) as fh:
        return json.load(fh)


def test_importance_weights_match_verl():
    """verl's rollout_is token|sequence with a cap (TIS) or a 'low_high' band (IcePop) = our *_truncate / *_mask."""
    f = _fixture()
    old, rollout = torch.tensor(f["old_log_probs"]), torch.tensor(f["rollout_log_probs"])
    mask = torch.tensor(f["response_mask"]).bool()
    for case in f["is"]:
        spec = case["threshold"]
        low, cap = (0.0, float(spec)) if not isinstance(spec, str) else map(float, spec.split("_"))
        mode = f"{case['level']}_{'mask' if isinstance(spec, str) else 'truncate'}"
        w, m = mismatch_weights(old, rollout, mask, mode, cap, low)
        torch.testing.assert_close(w.double(), torch.tensor(case["weights"], dtype=torch.float64), rtol=1e-5,
                                   atol=1e-7, msg=f"{mode} {spec}")
        assert float(m["is_weight_mean"]) == pytest.approx(case["is_mean"], rel=1e-5)
    kl = mismatch_weights(old, rollout, mask, None)[1]
    assert float(kl["mismatch_k1"]) == pytest.approx(f["offpolicy"]["kl"], rel=1e-4, abs=1e-7)
    assert float(kl["mismatch_k3"]) == pytest.approx(f["offpolicy"]["k3_kl"], rel=1e-5)


def test_rejection_criteria_match_verl():
    f = _fixture()
    old, rollout = torch.tensor(f["old_log_probs"]), torch.tensor(f["rollout_log_probs"])
    mask = torch.tensor(f["response_mask"]).bool()
    seen = set()
    for case in [*f["rs"], {"option": None, **f["rs_combined"]}]:
        spec = case.get("spec") or f"{case['option']}:{case['threshold']}"
        w, m = mismatch_weights(old, rollout, mask, None, rejection=spec)
        kept = torch.tensor(case["mask"]).bool()
        assert torch.equal(w > 0, kept), spec
        assert float(m["is_masked_frac"]) == pytest.approx(case["masked_fraction"], rel=1e-6), spec
        if "seq_masked_fraction" in case:  # every fixture row has a token, so verl's count of rows is ours
            assert float(m["is_seq_masked_frac"]) == pytest.approx(case["seq_masked_fraction"]), spec
        seen.add(case["option"])
    assert seen - {None} == set(REJECTION_CRITERIA)


def test_geo_mask_is_verl_s_seq_mean_k1_with_reciprocal_bounds():
    """geo_mask keeps rows whose exp(mean log(pi_train / pi_sampler)) lies in [low, cap]; seq_mean_k1 bounds
    exp(mean log(pi_sampler / pi_train)): the same rows for the band [1 / cap, 1 / low]."""
    f = _fixture()
    old, rollout = torch.tensor(f["old_log_probs"]), torch.tensor(f["rollout_log_probs"])
    mask = torch.tensor(f["response_mask"]).bool()
    case = next(c for c in f["rs"] if c["option"] == "seq_mean_k1")
    u = float(case["threshold"])  # verl: one number u is the band [1/u, u]
    w, _ = mismatch_weights(old, rollout, mask, "geo_mask", u, 1 / u)
    assert torch.equal(w > 0, torch.tensor(case["mask"]).bool())


def test_awkward_inputs_stay_finite():
    # every token masked: weights 0, metrics 0 (not NaN)
    z = torch.zeros(2, 3)
    for mode in IS_MODES:
        w, m = mismatch_weights(z, z, torch.zeros(2, 3, dtype=torch.bool), mode, rejection="seq_sum_k3:0.1")
        assert w.abs().sum() == 0 and all(math.isfinite(float(v)) and float(v) == 0 for v in m.values()), mode
    # T = 1
    w, _ = mismatch_weights(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.ones(1, 1, dtype=torch.bool),
                            "sequence_truncate", 2.0)
    assert w.tolist() == [[2.0]]
    # extreme log-ratios, and a token the sampler gave -inf (it cannot have drawn it)
    old = torch.tensor([[0.0, -1e4, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1e4, 0.0, -float("inf"), -1.0], [-1.0, -1.0, -1.0, float("nan")]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])  # NaN past the end
    for mode in IS_MODES:
        for rejection in (None, "token_k1:10,seq_sum_k3:1,seq_max_k2:1,seq_mean_k1:2"):
            w, m = mismatch_weights(old, rollout, mask, mode, 3.0, 0.0, rejection)
            assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in m.values()), (mode, rejection)
            assert w[1, 3] == 0
    w, m = mismatch_weights(old, rollout, mask, "token_truncate", 3.0)
    assert w[0].tolist() == [3.0, pytest.approx(math.exp(-20)), 3.0, 1.0]
    assert float(m["is_ratio_max"]) == pytest.approx(math.exp(20), rel=1e-6)


def test_bf16_inputs_are_computed_in_float32():
    old, rollout, mask = random_case(11)
    ob, rb = old.to(torch.bfloat16), rollout.to(torch.bfloat16)
    for mode in IS_MODES:
        w, m = mismatch_weights(ob, rb, mask, mode, 1.5, rejection="seq_mean_k3:0.05")
        w32, m32 = mismatch_weights(ob.float(), rb.float(), mask, mode, 1.5, rejection="seq_mean_k3:0.05")
        assert w.dtype == torch.float32 and torch.equal(w, w32)
        assert all(torch.equal(m[k], m32[k]) for k in m)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="clip"), r"mode must be one of \['truncate', 'token_truncate', .*got 'clip'"),
    (dict(mode="token_truncate", low=0.5), r"low=0.5 is the lower bound of a mask mode's band .*token_truncate"),
    (dict(mode="token_mask", low=1.0), r"low must be in \[0, 1\) .*got 1.0"),
    (dict(mode="token_mask", cap=0.9), r"cap must be >= 1 .*got 0.9"),
    (dict(rejection="token_k4:1"), r"criterion 'token_k4' is unknown; expected 'criterion:threshold"),
    (dict(rejection="seq_max_k1:2"), r"seq_max_k1 does not exist \(k1 is signed\): token_k1 bounds each token"),
    (dict(rejection="token_k3"), r"rejection 'token_k3' has no threshold"),
    (dict(rejection="token_k3:0.1_0.2"), r"token_k3 takes one upper bound, got '0.1_0.2'"),
    (dict(rejection="token_k1:2_0.5"), r"the band's low bound 2.0 exceeds its high bound 0.5"),
    (dict(rejection="token_k3:-1"), r"thresholds must be finite numbers > 0"),
    (dict(rejection="token_k3:x"), r"threshold 'x' is not a number"),
    (dict(rejection="token_k3:1,token_k3:2"), r"criterion 'token_k3' is given twice"),
    (dict(rejection=""), r"rejection must be None or a non-empty string"),
    (dict(rollout_log_probs=torch.zeros(2, 4)), r"rollout_log_probs has shape \(2, 4\) but old_log_probs has"),
])
def test_bad_input_is_refused_by_name(kwargs, match):
    args = dict(old_log_probs=torch.zeros(2, 3), rollout_log_probs=torch.zeros(2, 3),
                response_mask=torch.ones(2, 3, dtype=torch.bool), mode="token_truncate", cap=2.0, low=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        mismatch_weights(**args)


def test_parse_rejection_reads_verl_s_threshold_forms():
    assert parse_rejection(None) == ()
    (name, lo, hi), = parse_rejection("token_k1:2")
    assert name == "token_k1" and lo == pytest.approx(math.log(0.5)) and hi == pytest.approx(math.log(2))
    assert parse_rejection(" seq_mean_k1:0.9_1.1 , seq_max_k3:0.3 ")[1] == ("seq_max_k3", None, 0.3)


# ---------------------------------------------------------------------------------------------- PPOModel, config


def _hand_ppo(**kwargs):
    """tests/engines/test_vllm_training_is.py's hand case: token losses -1.2, -1.0, 0.8, 3.0, sampler log-probs
    whose ratios to the trainer's are 1, 3, 0.5, 1.9 (rows 1, 3 and 0.5, 1.9: products 3 and 0.95)."""
    base = make_ppo()
    ppo = PPOModel(base.actor, base.reward, critic=base.critic, ref=base.ref, state=base.state, algo=base.algo,
                   **kwargs)
    ppo.state.update({"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "entropy_coef": 0.0, "kl_coef": 0.0,
                      "kl_ctrl_type": "fixed", "temperature": 1.0})
    b = policy_batch(RATIOS, ADVANTAGES)
    b.rollout_log_probs = b.old_log_probs - torch.log(t([[1.0, 3.0], [0.5, 1.9]]))
    return ppo, b


@pytest.mark.parametrize("kwargs,token_weights", [
    (dict(is_cap=2.0), [1.0, 2.0, 0.5, 1.9]),
    (dict(is_cap=2.0, is_mode="token_mask", is_low=0.6), [1.0, 0.0, 0.0, 1.9]),
    (dict(is_cap=2.0, is_mode="sequence_truncate"), [2.0, 2.0, 0.95, 0.95]),
    (dict(is_cap=2.0, is_mode="sequence_mask"), [0.0, 0.0, 0.95, 0.95]),
    (dict(is_rejection="token_k1:2.5"), [1.0, 0.0, 1.0, 1.0]),  # pi_sampler / pi_train 1/3 is outside [0.4, 2.5]
    (dict(is_cap=2.0, is_mode="sequence_truncate", is_rejection="token_k1:2.5"), [2.0, 0.0, 0.95, 0.95]),
])
def test_ppo_model_weights_each_token_s_loss(kwargs, token_weights):
    ppo, b = _hand_ppo(**kwargs)
    loss, metrics = ppo.compute_policy_loss(b)
    want = sum(w * x for w, x in zip(token_weights, [-1.2, -1.0, 0.8, 3.0])) / 4
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert float(metrics["actor/is_weight_mean"]) == pytest.approx(sum(token_weights) / 4, abs=1e-6)
    assert float(metrics["actor/is_masked_frac"]) == pytest.approx(token_weights.count(0.0) / 4)
    assert float(metrics["actor/mismatch_k1"]) == pytest.approx(-math.log(3 * 0.5 * 1.9) / 4, abs=1e-6)
    # a masked token stays in the normaliser: the loss is the same sum over the 4 tokens with the trainer's count
    half, _ = ppo.compute_policy_loss(b, normalizer=8.0)
    assert half.item() == pytest.approx(want / 2, abs=1e-6)
    b.rollout_log_probs = None
    with pytest.raises(ValueError, match=r"batch.rollout_log_probs is missing"):
        ppo.compute_policy_loss(b)


def test_ppo_model_logs_the_gap_without_a_correction():
    """No correction: the loss is unweighted (0.4, the plain hand case) and the gap is still logged."""
    ppo, b = _hand_ppo()
    loss, metrics = ppo.compute_policy_loss(b)
    assert loss.item() == pytest.approx(0.4, abs=1e-6) and "actor/is_weight_mean" not in metrics
    assert float(metrics["actor/mismatch_k1"]) == pytest.approx(-math.log(3 * 0.5 * 1.9) / 4, abs=1e-6)
    assert float(metrics["actor/is_ratio_max"]) == pytest.approx(3.0) and float(metrics["actor/is_ratio_min"]) == 0.5


def test_ppo_model_refuses_contradictory_arguments():
    base = make_ppo()
    common = dict(critic=base.critic, ref=base.ref, state=base.state, algo=base.algo)
    for kwargs, match in ((dict(is_cap=2.0, is_mode="token_truncate", is_low=0.5), r"PPOModel: is_low=0.5 is the "),
                          (dict(is_mode="nope"), r"PPOModel: is_mode must be one of"),
                          (dict(is_rejection="seq_max_k1:2"), r"PPOModel: is_rejection criterion 'seq_max_k1'")):
        with pytest.raises(ValueError, match=match):
            PPOModel(base.actor, base.reward, **common, **kwargs)


@pytest.mark.parametrize("overrides,match", [
    (["rollout.is_mode=token_mask"], r"rollout.is_mode=token_mask, rollout.is_low=0.0: the importance weights are "
                                     r"off \(rollout.is_correction=false\)"),
    (["rollout.is_low=0.5"], r"rollout.is_low=0.5: the importance weights are off"),
    (["rollout.is_correction=true", "rollout.is_low=0.5"], r"rollout.is_mode=truncate, rollout.is_low=0.5: low=0.5 "
                                                           r"is the lower bound of a mask mode's band"),
    (["rollout.is_rejection=seq_k3:1"], r"rollout.is_rejection: rejection criterion 'seq_k3' is unknown"),
    (["rollout.is_rejection=token_k2:0.1_1"], r"rollout.is_rejection: .*token_k2 takes one upper bound"),
    (["rollout.is_low=1"], r"rollout.is_low: 1.0 is out of range"),
])
def test_contradictory_config_is_refused_at_start_up(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_config(load_config(None, [f"trainer.output_dir={tmp_path}/run", *overrides]))


@pytest.mark.parametrize("overrides", [
    [],
    ["rollout.is_mode=decoupled"],  # accepted (and without effect) before the modes were widened: kept
    ["rollout.is_correction=true"],
    ["rollout.is_correction=true", "rollout.is_mode=token_mask", "rollout.is_low=0.5", "rollout.is_cap=2"],
    ["rollout.is_correction=true", "rollout.is_mode=geo_mask", "rollout.is_low=0.999", "rollout.is_cap=1.001"],
    ["rollout.is_rejection=token_k3:0.01,seq_mean_k1:0.999_1.001"],
])
def test_good_config_passes(tmp_path, overrides):
    check_config(load_config(None, [f"trainer.output_dir={tmp_path}/run", *overrides]))


def test_token_mean_loss_of_masked_tokens_matches_zero_weights():
    """What aggregation sees: the left-out token's loss is 0 and the normaliser counts it (TRL's choice)."""
    w, _ = mismatch_weights(torch.zeros(1, 2), torch.tensor([[0.0, -3.0]]), torch.ones(1, 2, dtype=torch.bool),
                            "token_mask", 2.0)
    assert w.tolist() == [[1.0, 0.0]]
    assert agg_loss(w * torch.tensor([[2.0, 5.0]]), torch.ones(1, 2, dtype=torch.bool)).item() == 1.0


@pytest.mark.slow
def test_streaming_run_with_a_stale_sampler_logs_the_mismatch_and_masks(tmp_path):
    """One rank, rollout.mode=streaming with max_staleness 1: samples drawn with the weights before an update
    differ from the trainer's log-probs (the HF sampler is otherwise the trainer), so from step 2 the band
    [0.9, 1.05] of sequence_mask and token_k3's 1e-3 leave tokens out, and the metrics say how many."""
    from e2e_utils import read_metrics, run_train

    out = str(tmp_path / "run")
    run_train(out, ["algo.adv_estimator=grpo", "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
                    "trainer.total_steps=3", "trainer.val_every=0", "trainer.export=none", "actor.lr=1e-2",
                    "rollout.mode=streaming", "rollout.max_staleness=1", "rollout.is_correction=true",
                    "rollout.is_mode=sequence_mask", "rollout.is_low=0.9", "rollout.is_cap=1.05",
                    "rollout.is_rejection=token_k3:0.001"], timeout=400)
    rows = [r for r in read_metrics(out) if "training/global_step" in r]
    assert [r["training/global_step"] for r in rows] == [1, 2, 3]
    keys = ("actor/is_weight_mean", "actor/is_capped_frac", "actor/is_masked_frac", "actor/is_seq_masked_frac",
            "actor/is_ratio_min", "actor/is_ratio_max", "actor/mismatch_k1", "actor/mismatch_k3",
            "actor/mismatch_seq_k1")
    for r in rows:
        assert all(math.isfinite(r[k]) for k in keys) and math.isfinite(r["actor/pg_loss"])
    stale = [r for r in rows if r["async/staleness/max"] >= 1]  # step 1's samples are the first weights
    assert stale, "no step trained on stale samples"
    for r in stale:
        assert r["actor/mismatch_k3"] > 0 and r["actor/is_ratio_max"] > r["actor/is_ratio_min"]
    assert max(r["actor/is_masked_frac"] for r in stale) > 0
