"""verl_ds.algos PPO policy loss (dual clip) and value loss."""
import math

import pytest
import torch
from algos_refs import ppo_token_loss

from verl_ds.algos import agg_loss, policy_loss, value_loss

LOG = math.log

# (advantage, ratio, clip_ratio_c) -> (loss, pg_clipfrac, pg_clipfrac_lower); eps_low = eps_high = 0.2
DUAL_CLIP_TABLE = [
    (2.0, 1.1, 3.0, -2.2, 0.0, 0.0),    # A>0, inside the trust region: -A rho
    (2.0, 1.5, 3.0, -2.4, 1.0, 0.0),    # A>0, rho above 1+eps: clipped to -A (1+eps)
    (2.0, 0.5, 3.0, -1.0, 0.0, 0.0),    # A>0, rho below 1-eps: unclipped -A rho is the max
    (-2.0, 0.9, 3.0, 1.8, 0.0, 0.0),    # A<0, inside: -A rho
    (-2.0, 0.5, 3.0, 1.6, 1.0, 0.0),    # A<0, rho below 1-eps: clipped to -A (1-eps)
    (-2.0, 2.0, 3.0, 4.0, 0.0, 0.0),    # A<0, 1+eps < rho < c: -A rho, below the cap
    (-2.0, 5.0, 3.0, 6.0, 0.0, 1.0),    # A<0, rho > c: dual clip caps at -c A
    (-2.0, 5.0, None, 10.0, 0.0, 0.0),  # dual clip disabled: -A rho
    (0.0, 5.0, 3.0, 0.0, 0.0, 0.0),     # A = 0: no loss
]


@pytest.mark.parametrize("adv,ratio,c,loss,clipfrac,lower", DUAL_CLIP_TABLE)
def test_dual_clip_truth_table(adv, ratio, c, loss, clipfrac, lower):
    lp = torch.tensor([[LOG(ratio) - 1.0]])
    old = torch.tensor([[-1.0]])
    out, metrics = policy_loss(lp, old, torch.tensor([[adv]]), torch.ones(1, 1, dtype=torch.bool),
                               clip_ratio_c=c)
    assert out.item() == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == clipfrac
    assert metrics["pg_clipfrac_lower"].item() == lower
    assert metrics["ppo_kl"].item() == pytest.approx(-LOG(ratio), abs=1e-6)
    # metrics are 0-d detached float32 tensors: the trainer syncs them once per step
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float32 and not v.requires_grad


def test_policy_loss_against_reference_loop_and_asymmetric_clip():
    b, t = 4, 11
    lp, old = torch.randn(b, t) * 0.5 - 2, torch.randn(b, t) * 0.5 - 2
    adv = torch.randn(b, t) * 2
    mask = torch.rand(b, t) > 0.3
    mask[0, 0] = True
    low, high, c = 0.1, 0.28, 2.5  # DAPO-style clip-higher
    out, metrics = policy_loss(lp, old, adv, mask, low, high, c, "seq-mean-token-mean")
    per_tok = torch.zeros(b, t)
    n = clip = lower = 0
    for i in range(b):
        for j in range(t):
            val, cl, lo = ppo_token_loss(float(lp[i, j]), float(old[i, j]), float(adv[i, j]), low, high, c)
            per_tok[i, j] = val
            if mask[i, j]:
                n, clip, lower = n + 1, clip + cl, lower + lo
    assert out.item() == pytest.approx(agg_loss(per_tok, mask, "seq-mean-token-mean").item(), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clip / n)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower / n)
    assert metrics["ppo_kl"].item() == pytest.approx(((old - lp)[mask]).mean().item(), abs=1e-6)


def test_policy_loss_gradient_and_nan_padding():
    lp = torch.randn(2, 5, requires_grad=True)
    old = lp.detach().clone()
    adv = torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    adv_bad = adv.masked_fill(~mask, float("nan"))
    old_bad = old.masked_fill(~mask, float("inf"))
    loss, metrics = policy_loss(lp, old_bad, adv_bad, mask)
    loss.backward()
    # on-policy (rho = 1, no clipping): d loss / d logprob = -A / N_tok on valid tokens, 0 elsewhere
    torch.testing.assert_close(lp.grad, torch.where(mask, -adv / 8, torch.zeros(())))
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0
    assert not any(v.requires_grad for v in metrics.values())


def test_huge_log_ratio_is_clamped():
    loss, _ = policy_loss(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.tensor([[1.0]]),
                          torch.ones(1, 1), clip_ratio_c=None)
    assert loss.item() == pytest.approx(-1.2)  # clipped; exp(100) never formed
    loss, _ = policy_loss(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.tensor([[-1.0]]),
                          torch.ones(1, 1), clip_ratio_c=None)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_policy_loss_errors():
    a = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"shape mismatch: advantages has shape \(2, 1\) but log_probs has shape "
                                         r"\(2, 3\)"):
        policy_loss(a, a, a[:, :1], m)
    with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1"):
        policy_loss(a, a, a, torch.full((2, 3), 0.3))
    with pytest.raises(ValueError, match="clip_ratio_c must be a number > 1 .* got 1.0"):
        policy_loss(a, a, a, m, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"clip_ratio_low must be in \[0, 1\)"):
        policy_loss(a, a, a, m, clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="clip_ratio_high must be a finite number >= 0, got -0.2"):
        policy_loss(a, a, a, m, clip_ratio_high=-0.2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        policy_loss(a, a, a, m, loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"log_probs must have shape \(B, R\), got shape \(6,\)"):
        policy_loss(a.view(6), a.view(6), a.view(6), m.view(6))


# --- value loss ------------------------------------------------------------------------------------

def test_value_loss_hand_computed():
    v = torch.tensor([[1.0, 2.0, 0.0]])
    old = torch.tensor([[0.0, 2.0, 0.0]])
    ret = torch.tensor([[0.0, 3.0, 100.0]])
    m = torch.tensor([[True, True, False]])
    # token 0: v - old = 1 clipped to 0.5: max((1-0)^2, (0.5-0)^2) = 1; token 1: unclipped, (2-3)^2 = 1
    loss, metrics = value_loss(v, old, ret, m, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert metrics["vf_clipfrac"].item() == 0.0
    # token 0 with return 2: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> the clipped term counts
    loss, metrics = value_loss(v, old, torch.tensor([[2.0, 3.0, 0.0]]), m, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1) / 2)
    assert metrics["vf_clipfrac"].item() == 0.5
    loss, metrics = value_loss(v, old, torch.tensor([[2.0, 3.0, 0.0]]), m, cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2) and metrics["vf_clipfrac"].item() == 0.0
    assert metrics["vpred_mean"].item() == pytest.approx(1.5)


@pytest.mark.parametrize("cliprange", [0, 0.0, None])
def test_value_loss_zero_or_none_cliprange_means_no_clipping(cliprange):
    # V = 0.5 is closer to R = 1 than V_old = 0: max((V-R)^2, (V_old-R)^2) would have a zero gradient
    v = torch.tensor([[0.5]], requires_grad=True)
    loss, metrics = value_loss(v, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), cliprange)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 0.25)
    assert v.grad.item() == pytest.approx(-0.5)  # d/dV 0.5 (V - R)^2 = V - R, the unclipped loss's gradient
    assert metrics["vf_clipfrac"].item() == 0.0 and metrics["vpred_mean"].item() == 0.5
    assert all(isinstance(x, torch.Tensor) and not x.requires_grad for x in metrics.values())


def test_value_loss_against_loop_gradient_and_normalizer():
    v = torch.randn(3, 7, requires_grad=True)
    old, ret = torch.randn(3, 7), torch.randn(3, 7)
    m = torch.rand(3, 7) > 0.3
    m[0, 0] = True
    loss, metrics = value_loss(v, old.masked_fill(~m, float("nan")), ret, m, 0.2, normalizer=5.0)
    per_tok = [[max((a - r) ** 2, (o + min(max(a - o, -0.2), 0.2) - r) ** 2) for a, o, r in zip(ra, ro, rr)]
               for ra, ro, rr in zip(v.tolist(), old.tolist(), ret.tolist())]
    expected = 0.5 * sum(x for row, mr in zip(per_tok, m.tolist()) for x, k in zip(row, mr) if k) / 5.0
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert torch.isfinite(v.grad).all() and torch.equal(v.grad[~m], torch.zeros(int((~m).sum())))


def test_value_loss_errors():
    a = torch.zeros(2, 3)
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"shape mismatch: returns has shape \(2, 4\) but values has shape \(2, 3\)"):
        value_loss(a, a, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match="cliprange_value must be a finite number >= 0, got -1.0"):
        value_loss(a, a, a, m, cliprange_value=-1.0)
    with pytest.raises(TypeError, match="old_values must be a floating tensor"):
        value_loss(a, a.long(), a, m)
