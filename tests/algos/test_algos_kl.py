"""verl_ds.algos.kl: the sampled-token KL estimators."""
import math

import pytest
import torch

from verl_ds.algos import KL_KINDS, kl_penalty


def _per_token_ref(d, kind):
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    dc = min(max(d, -20.0), 20.0)
    if kind in ("k3", "low_var_kl"):
        return min(max(math.exp(-dc) - 1 + dc, -10.0), 10.0)
    return 0.5 * dc * (1 - math.exp(-dc))


@pytest.mark.parametrize("kind", KL_KINDS)
def test_estimators_match_their_definitions(kind):
    lp = torch.tensor([[-1.0, -2.5, -0.1, -30.0], [-3.0, -0.2, -50.0, -1.0]])
    ref = torch.tensor([[-1.0, -2.0, -0.6, -1.0], [-1.0, -0.3, -1.0, -40.0]])
    out = kl_penalty(lp, ref, kind)
    assert out.dtype == torch.float32 and out.shape == lp.shape
    expected = [[_per_token_ref(a - b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-6, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_hand_computed_values_and_aliases():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # d = log 2
    d = math.log(2)
    assert kl_penalty(lp, ref, "kl").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "mse").item() == pytest.approx(d * d / 2)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d)
    assert kl_penalty(lp, ref, "symmetric").item() == pytest.approx(0.5 * d * 0.5)
    for a, b in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        torch.testing.assert_close(kl_penalty(lp, ref, a), kl_penalty(lp, ref, b))


def test_k3_clamps_as_verl():
    # d = -30: -d clamped to 20, exp(20) - 1 - 20 >> 10, so the result is clamped to 10
    assert kl_penalty(torch.tensor([-31.0]), torch.tensor([-1.0]), "k3").item() == 10.0
    # d = +30: exp(-20) - 1 + 20 ~ 19 -> 10
    assert kl_penalty(torch.tensor([-1.0]), torch.tensor([-31.0]), "k3").item() == 10.0


def test_estimators_are_unbiased_in_expectation():
    # sample from pi, average: k1, k3 -> KL(pi||ref); symmetric -> (KL(pi||ref) + KL(ref||pi)) / 2
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    kl_pq = (p * (p / q).log()).sum().item()
    kl_qp = (q * (q / p).log()).sum().item()
    # exact expectation over the six tokens (no sampling noise)
    lp, lq = p.log().float(), q.log().float()
    for kind, expected in (("k1", kl_pq), ("k3", kl_pq), ("symmetric", 0.5 * (kl_pq + kl_qp))):
        est = (p.float() * kl_penalty(lp, lq, kind)).sum().item()
        assert est == pytest.approx(expected, abs=1e-6), kind


def test_symmetric_estimator_is_non_negative_and_differentiable():
    d = torch.linspace(-30, 30, 101)
    lp = d.clone().requires_grad_()
    out = kl_penalty(lp, torch.zeros(101), "symmetric")
    assert (out >= 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_kl_penalty_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown KL kind 'k4'; valid kinds: k1, kl, abs, k2, mse, k3, "
                                         r"low_var_kl, symmetric"):
        kl_penalty(a, a, "k4")
    with pytest.raises(ValueError, match=r"shape mismatch: ref_log_probs has shape \(2, 2\) but log_probs has shape "
                                         r"\(2, 3\)"):
        kl_penalty(a, torch.zeros(2, 2), "k1")
    with pytest.raises(TypeError, match="ref_log_probs must be a floating tensor"):
        kl_penalty(a, torch.zeros(2, 3, dtype=torch.long), "k1")
