"""verl_ds.stages.losses: the Bradley-Terry reward-model loss and DPO (sigmoid, conservative, IPO, reference-free)
on hand-computed cases, against a float64 loop of the papers' formulas, with hand-derived gradients, and against
TRL's published formulas (DPOTrainer.dpo_loss and RewardTrainer.compute_loss, written out below from TRL's source:
https://github.com/huggingface/trl/blob/main/trl/trainer/dpo_trainer.py, reward_trainer.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

from verl_ds.stages.losses import dpo_loss, mean_metrics, reward_model_loss, sequence_logps


def softplus(x: float) -> float:  # -log sigmoid(-x), in float64
    return math.log1p(math.exp(x)) if x < 30 else x + math.log1p(math.exp(-x))


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def t(*xs, dtype=torch.float32, grad=False):
    return torch.tensor(xs, dtype=dtype, requires_grad=grad)


# ---- TRL's formulas, written out (not imported: trl is not a dependency) --------------------------------------------

def trl_reward_loss(rewards_chosen, rewards_rejected, margin=None):
    """RewardTrainer.compute_loss: the mean of -logsigmoid(chosen - rejected [- margin])."""
    if margin is not None:
        return -F.logsigmoid(rewards_chosen - rewards_rejected - margin).mean()
    return -F.logsigmoid(rewards_chosen - rewards_rejected).mean()


def trl_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type="sigmoid",
                 label_smoothing=0.0, reference_free=False):
    """DPOTrainer.dpo_loss (sigmoid and ipo branches) and the reward metrics of get_batch_loss_metrics."""
    logratios = chosen_logps - rejected_logps
    ref_logratios = torch.tensor([0.0]) if reference_free else ref_chosen_logps - ref_rejected_logps
    logits = logratios - ref_logratios
    if loss_type == "sigmoid":
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    metrics = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
               "logps/chosen": chosen_logps.detach().mean(), "logps/rejected": rejected_logps.detach().mean()}
    return losses.mean(), metrics


# ---- the reward-model loss -----------------------------------------------------------------------------------------

def test_reward_loss_hand_case():
    losses, m = reward_model_loss(t(1.0, 0.0, 2.0), t(0.0, 1.0, 2.0))
    # diffs 1, -1, 0: -log sigmoid(d) = log(1 + e^-d)
    want = [math.log(1 + math.exp(-1)), math.log(1 + math.e), math.log(2)]
    torch.testing.assert_close(losses, torch.tensor(want), atol=1e-6, rtol=0)
    assert float(m["accuracy"]) == pytest.approx(1 / 3)  # a tie is not a correct ranking (TRL: chosen > rejected)
    assert float(m["margin"]) == pytest.approx(0.0, abs=1e-7)


def test_reward_loss_margin_hand_case_and_metrics_ignore_it():
    losses, m = reward_model_loss(t(1.0, 3.0), t(0.0, 1.0), margin=t(0.5, 2.0))
    torch.testing.assert_close(losses, torch.tensor([math.log(1 + math.exp(-0.5)), math.log(2)]), atol=1e-6, rtol=0)
    assert float(m["margin"]) == pytest.approx(1.5)  # the rewards' margin, not the required one
    assert float(m["accuracy"]) == 1.0


def test_reward_loss_matches_float64_loop_and_trl():
    g = torch.Generator().manual_seed(1)
    rc, rr, mg = (torch.randn(64, generator=g, dtype=torch.float64) * 4 for _ in range(3))
    losses, m = reward_model_loss(rc.float(), rr.float(), margin=mg.float())
    want = [softplus(-(a - b - c)) for a, b, c in zip(rc.tolist(), rr.tolist(), mg.tolist())]
    torch.testing.assert_close(losses.double(), torch.tensor(want, dtype=torch.float64), atol=2e-6, rtol=1e-6)
    assert float(losses.mean()) == pytest.approx(float(trl_reward_loss(rc, rr, mg)), abs=1e-6)
    assert float(reward_model_loss(rc, rr)[0].mean()) == pytest.approx(float(trl_reward_loss(rc, rr)), abs=1e-12)
    assert float(m["accuracy"]) == pytest.approx(float((rc > rr).double().mean()))


def test_reward_loss_gradient_is_minus_sigmoid_of_minus_diff():
    rc, rr = t(1.0, -2.0, 0.3, grad=True), t(0.0, 1.0, 0.3, grad=True)
    mg = t(0.2, 0.0, -1.0)
    losses, _ = reward_model_loss(rc, rr, margin=mg)
    losses.sum().backward()
    # d/d r_chosen -log sigmoid(r_c - r_r - m) = -sigmoid(-(r_c - r_r - m)); d/d r_rejected is its negative
    want = torch.tensor([-sig(-(a - b - c)) for a, b, c in zip([1.0, -2.0, 0.3], [0.0, 1.0, 0.3], [0.2, 0.0, -1.0])])
    torch.testing.assert_close(rc.grad, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(rr.grad, -want, atol=1e-6, rtol=0)


def test_reward_loss_stays_finite_for_huge_gaps():
    losses, _ = reward_model_loss(t(0.0, 500.0), t(500.0, 0.0))
    assert torch.isfinite(losses).all()
    assert float(losses[0]) == pytest.approx(500.0) and float(losses[1]) == pytest.approx(0.0, abs=1e-6)


def test_reward_loss_refusals():
    with pytest.raises(ValueError, match="rejected_rewards has shape"):
        reward_model_loss(t(1.0, 2.0), t(1.0))
    with pytest.raises(ValueError, match="chosen_rewards must be 1-D"):
        reward_model_loss(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(TypeError, match="floating"):
        reward_model_loss(torch.tensor([1, 2]), torch.tensor([1, 2]))


# ---- DPO -----------------------------------------------------------------------------------------------------------

def test_dpo_sigmoid_hand_case_and_metrics():
    # x = (-1 - -3) - (-2 - -2) = 2; beta 0.5: loss = -log sigmoid(1) = log(1 + e^-1)
    losses, m = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5)
    assert float(losses[0]) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx(0.5)  # 0.5 * (-1 - -2)
    assert float(m["rewards/rejected"]) == pytest.approx(-0.5)  # 0.5 * (-3 - -2)
    assert float(m["rewards/margins"]) == pytest.approx(1.0)
    assert float(m["rewards/accuracies"]) == 1.0
    assert float(m["logps/chosen"]) == -1.0 and float(m["logps/rejected"]) == -3.0


def test_dpo_label_smoothing_ipo_reference_free_hand_cases():
    args = (t(-1.0), t(-3.0), t(-2.0), t(-2.0))
    losses, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.1)
    assert float(losses[0]) == pytest.approx(0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.e), abs=1e-6)
    losses, _ = dpo_loss(*args, beta=0.5, loss_type="ipo")
    assert float(losses[0]) == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)  # (x - 1/(2 beta))^2 = 1
    # reference-free: x = -1 - -4 = 3 whatever the reference held; rewards are beta * log pi
    losses, m = dpo_loss(t(-1.0), t(-4.0), None, None, beta=0.5, reference_free=True)
    assert float(losses[0]) == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx(-0.5) and float(m["rewards/rejected"]) == pytest.approx(-2.0)
    same, _ = dpo_loss(t(-1.0), t(-4.0), t(7.0), t(-9.0), beta=0.5, reference_free=True)
    assert float(same[0]) == float(losses[0])


@pytest.mark.parametrize("loss_type,eps,free", [("sigmoid", 0.0, False), ("sigmoid", 0.2, False),
                                                ("ipo", 0.0, False), ("sigmoid", 0.0, True)])
def test_dpo_matches_float64_loop(loss_type, eps, free):
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (torch.randn(48, generator=g, dtype=torch.float64) * 6 - 10 for _ in range(4))
    beta = 0.3
    losses, m = dpo_loss(pc.float(), pr.float(), rc.float(), rr.float(), beta=beta, loss_type=loss_type,
                         label_smoothing=eps, reference_free=free)
    want, acc = [], 0
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist()):
        c, d = (0.0, 0.0) if free else (c, d)
        x = (a - b) - (c - d)
        if loss_type == "ipo":
            want.append((x - 1 / (2 * beta)) ** 2)
        else:  # -log sigmoid(z) = softplus(-z)
            want.append((1 - eps) * softplus(-beta * x) + eps * softplus(beta * x))
        acc += beta * (a - c) > beta * (b - d)
    torch.testing.assert_close(losses.double(), torch.tensor(want, dtype=torch.float64), atol=5e-5, rtol=1e-5)
    assert float(m["rewards/accuracies"]) == pytest.approx(acc / 48)
    # float64 in, float64 out: the loss is then exact to rounding
    l64, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps, reference_free=free)
    assert l64.dtype == torch.float64
    torch.testing.assert_close(l64, torch.tensor(want, dtype=torch.float64), atol=1e-10, rtol=1e-12)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.25), ("ipo", 0.0)])
def test_dpo_gradient_matches_hand_derivation(loss_type, eps):
    beta = 0.7
    vals = [(-1.0, -3.0, -2.0, -2.5), (-5.0, -1.0, -4.0, -2.0), (-0.5, -0.5, -1.0, -1.0)]
    pc, pr, rc, rr = (t(*col, dtype=torch.float64, grad=True) for col in zip(*vals))
    losses, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps)
    losses.sum().backward()
    want = []
    for a, b, c, d in vals:
        x = (a - b) - (c - d)
        if loss_type == "ipo":
            want.append(2 * (x - 1 / (2 * beta)))
        else:  # d/dx: -(1 - eps) beta sigmoid(-beta x) + eps beta sigmoid(beta x)
            want.append(-(1 - eps) * beta * sig(-beta * x) + eps * beta * sig(beta * x))
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(pc.grad, want, atol=1e-12, rtol=0)  # dx/d log pi(y+) = 1
    torch.testing.assert_close(pr.grad, -want, atol=1e-12, rtol=0)  # dx/d log pi(y-) = -1
    assert rc.grad is None and rr.grad is None  # the reference is a constant


@pytest.mark.parametrize("loss_type,eps,free", [("sigmoid", 0.0, False), ("sigmoid", 0.1, False),
                                                ("ipo", 0.0, False), ("sigmoid", 0.0, True), ("ipo", 0.0, True)])
def test_dpo_parity_with_trl_formula(loss_type, eps, free):
    g = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (torch.randn(32, generator=g) * 3 - 8 for _ in range(4))
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    losses, m = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type=loss_type, label_smoothing=eps, reference_free=free)
    ours = losses.mean()
    (g_pc, g_pr) = torch.autograd.grad(ours, (pc, pr))
    theirs, tm = trl_dpo_loss(pc, pr, rc, rr, 0.1, loss_type, eps, free)
    (t_pc, t_pr) = torch.autograd.grad(theirs, (pc, pr))
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    torch.testing.assert_close(g_pc, t_pc, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(g_pr, t_pr, atol=1e-7, rtol=1e-6)
    # TRL's rewards subtract a reference's log-probs even when the loss is reference-free; ours use a zero reference
    keys = ["logps/chosen", "logps/rejected"] + ([] if free else
                                                 ["rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                  "rewards/margins"])
    for k in keys:
        assert float(m[k]) == pytest.approx(float(tm[k]), abs=1e-6), k


def test_dpo_refusals_name_the_argument():
    a = t(-1.0, -2.0)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(a, a, a, a, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(a, a, a, a, beta=0.0)
    with pytest.raises(ValueError, match="beta must be a finite number"):
        dpo_loss(a, a, a, a, beta=float("nan"))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_loss(a, a, a, a, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="sigmoid loss only"):
        dpo_loss(a, a, a, a, beta=0.1, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="required unless reference_free"):
        dpo_loss(a, a, None, None, beta=0.1)
    with pytest.raises(ValueError, match="ref_rejected_logps has shape"):
        dpo_loss(a, a, a, t(1.0), beta=0.1)


# ---- sequence log-probs --------------------------------------------------------------------------------------------

def test_sequence_logps_sum_completion_tokens_only():
    lp = torch.tensor([[-9.0, -1.0, -2.0, float("nan")], [-5.0, -5.0, -0.5, -0.25]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])  # prompt and padding out; the NaN sits in padding
    torch.testing.assert_close(sequence_logps(lp, mask), torch.tensor([-3.0, -0.75]))
    torch.testing.assert_close(sequence_logps(lp, mask, average=True), torch.tensor([-1.5, -0.375]))
    lp.requires_grad_(True)
    sequence_logps(lp, mask.bool()).sum().backward()
    torch.testing.assert_close(lp.grad, mask.float())
    with pytest.raises(ValueError, match=r"mask rows \[1\] have no completion token"):
        sequence_logps(lp, torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        sequence_logps(lp, torch.full((2, 4), 2))


def test_mean_metrics_weights_by_pairs():
    # two micro-batches of 1 and 3 pairs: their pair-weighted mean equals the metrics of the 4 pairs together
    rc, rr = t(1.0, 0.0, 3.0, -1.0), t(0.0, 2.0, 1.0, 0.5)
    _, whole = reward_model_loss(rc, rr)
    parts = [(reward_model_loss(rc[:1], rr[:1])[1], 1), (reward_model_loss(rc[1:], rr[1:])[1], 3)]
    got = mean_metrics(parts)
    for k in whole:
        assert got[k] == pytest.approx(float(whole[k]))
    with pytest.raises(ValueError, match="at least one"):
        mean_metrics([])
