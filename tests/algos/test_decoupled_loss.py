"""The decoupled PPO objective (AReaL, Fu et al. 2025, arXiv:2505.24298, eq. 5): behaviour weights pi_prox / pi_behav,
tokens over the cap left out, the clipped ratio taken against pi_prox. Checked against a float64 loop written from
the paper's formula and against a case worked by hand."""
import math

import pytest
import torch

from verl_ds.algos import policy_loss
from verl_ds.algos.mismatch import decoupled_is_weights, truncated_is_weights


def _reference(logp, prox, behav, adv, mask, eps_low, eps_high, cap):
    """float64, token by token: sum over valid tokens of w * max(-A r, -A clip(r)) / #valid, w = pi_prox / pi_behav
    (0 when w > cap), r = pi / pi_prox."""
    total, count = 0.0, 0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            count += 1
            w = math.exp(prox[b][t] - behav[b][t])
            if w > cap:
                continue
            r = math.exp(logp[b][t] - prox[b][t])
            a = adv[b][t]
            total += w * max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
    return total / count


def test_decoupled_loss_matches_a_float64_loop_and_its_gradient():
    g = torch.Generator().manual_seed(3)
    B, R = 5, 7
    prox = -torch.rand(B, R, generator=g, dtype=torch.float64) * 2
    behav = prox + (torch.rand(B, R, generator=g, dtype=torch.float64) - 0.5) * 2.5  # some weights past the cap
    logp = prox + (torch.rand(B, R, generator=g, dtype=torch.float64) - 0.5) * 0.8  # some ratios clipped
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = torch.rand(B, R, generator=g) > 0.2
    mask[:, 0] = True
    cap = 2.0
    w, metrics = decoupled_is_weights(prox.float(), behav.float(), mask, cap)
    over = ((prox - behav).exp() > cap) & mask
    assert over.any() and (~over & mask).any()  # both kinds of token occur
    assert float(metrics["is_capped_frac"]) == pytest.approx(float(over.sum() / mask.sum()))
    lp = logp.float().clone().requires_grad_(True)
    loss, _ = policy_loss(lp, prox.float(), adv.float(), mask, 0.2, 0.28, None, "token-mean", is_weights=w)
    ref = _reference(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, cap)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    loss.backward()
    # gradient: d/dlogp of w * max(-A r, -A clip(r)) is -w A r where the unclipped term is the larger, else 0
    r = (logp - prox).exp()
    clipped = r.clamp(0.8, 1.28)
    unclipped_wins = (-adv * r) >= (-adv * clipped)
    wd = torch.where(over | ~mask, torch.zeros_like(r), (prox - behav).exp())
    expected = torch.where(unclipped_wins & mask, -wd * adv * r, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(lp.grad.double(), expected, rtol=1e-4, atol=1e-6)


def test_decoupled_loss_by_hand_and_how_it_differs_from_truncated_is():
    """Token 1: pi_prox 0.5, pi_behav 0.25 (w = 2), pi 0.55 (r = 1.1), A = 1: -2 * 1.1 = -2.2.
    Token 2: pi_prox 0.2, pi_behav 0.05 (w = 4 > cap 3), A = -1, r = 1: decoupled leaves it out: loss -2.2 / 2;
    truncated IS keeps it at w = 3: (-2.2 + 3) / 2."""
    ln = lambda *p: torch.tensor([[math.log(x) for x in p]])  # noqa: E731
    prox, behav, logp = ln(0.5, 0.2), ln(0.25, 0.05), ln(0.55, 0.2)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.tensor([[True, True]])
    w, m = decoupled_is_weights(prox, behav, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0]]))
    assert float(m["is_capped_frac"]) == 0.5 and float(m["is_weight_mean"]) == pytest.approx(1.0)
    loss, _ = policy_loss(logp, prox, adv, mask, 0.2, 0.2, None, "token-mean", is_weights=w)
    assert float(loss) == pytest.approx(-1.1, rel=1e-6)
    tw, _ = truncated_is_weights(prox, behav, mask, cap=3.0)
    loss_tis, _ = policy_loss(logp, prox, adv, mask, 0.2, 0.2, None, "token-mean", is_weights=tw)
    assert float(loss_tis) == pytest.approx(0.4, rel=1e-6)


def test_on_policy_tokens_get_weight_one_and_bad_cap_is_refused():
    lp = torch.log(torch.tensor([[0.3, 0.6]]))
    w, _ = decoupled_is_weights(lp, lp, torch.tensor([[True, False]]))
    assert w.tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="cap must be >= 1"):
        decoupled_is_weights(lp, lp, torch.ones(1, 2, dtype=torch.bool), cap=0.5)
