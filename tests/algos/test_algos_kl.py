"""verl_ds.algos KL estimators and the full-vocabulary symmetric KL."""
import math

import pytest
import torch
from algos_refs import symmetric_kl_loop

from verl_ds.algos import KL_KINDS, full_symmetric_kl, kl_penalty
from verl_ds.algos.kl import full_symmetric_kl_torch


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


# --- full-vocabulary symmetric KL ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_full_symmetric_kl_matches_float64_loop(dtype, temperature):
    x = (torch.randn(3, 4, 23) * 2).to(dtype)
    y = (torch.randn(3, 4, 23) * 2).to(dtype)
    out = full_symmetric_kl(x, y, temperature)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), symmetric_kl_loop(x, y, temperature), atol=2e-6, rtol=1e-5)
    assert (out >= 0).all()


def test_full_symmetric_kl_hand_computed_and_identities():
    # p = (1/2, 1/2), q = (1/4, 3/4): 0.5 * sum (p - q)(log p - log q)
    x = torch.tensor([[0.0, 0.0]])
    y = torch.tensor([[0.0, math.log(3.0)]])
    expected = 0.5 * ((0.5 - 0.25) * math.log(0.5 / 0.25) + (0.5 - 0.75) * math.log(0.5 / 0.75))
    assert full_symmetric_kl(x, y).item() == pytest.approx(expected, abs=1e-7)
    # symmetric in its arguments, zero on equal inputs and on a constant shift, V = 1 gives 0
    a, b = torch.randn(5, 17), torch.randn(5, 17)
    torch.testing.assert_close(full_symmetric_kl(a, b), full_symmetric_kl(b, a))
    assert full_symmetric_kl(a, a + 3.0).abs().max().item() < 1e-6
    assert torch.equal(full_symmetric_kl(torch.randn(4, 1), torch.randn(4, 1)), torch.zeros(4))


def test_full_symmetric_kl_huge_logits_and_masked_vocab():
    x = torch.randn(4, 30, dtype=torch.float64) * 1e4
    y = x + torch.randn(4, 30, dtype=torch.float64)
    out = full_symmetric_kl(x.float(), y.float())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), symmetric_kl_loop(x.float(), y.float()), atol=1e-3, rtol=1e-3)
    # an entry masked (-inf) in both carries no mass in either: same as dropping it
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    a[:, 2] = b[:, 2] = -float("inf")
    xa = a.clone().requires_grad_()
    out = full_symmetric_kl(xa, b)
    out.sum().backward()
    keep = [i for i in range(8) if i != 2]
    torch.testing.assert_close(out, full_symmetric_kl(a[:, keep], b[:, keep]))
    assert torch.isfinite(xa.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_symmetric_kl_gradients_match_autograd(dtype):
    x = (torch.randn(7, 31) * 2).to(dtype)
    y = (torch.randn(7, 31) * 2).to(dtype)
    w = torch.randn(7)
    xg = x.clone().requires_grad_()
    (w * full_symmetric_kl_torch(xg, y, 0.8, chunk_rows=3)).sum().backward()
    x64 = x.double().requires_grad_()
    y64 = y.double().requires_grad_()
    lp, lq = torch.log_softmax(x64 / 0.8, -1), torch.log_softmax(y64 / 0.8, -1)
    ref = 0.5 * ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1)
    (w * ref).sum().backward()
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(xg.grad.double(), x64.grad, atol=atol, rtol=1e-2)
    # ref logits get a gradient too when they ask for one
    xg2, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    (w * full_symmetric_kl(xg2, yg, 0.8)).sum().backward()
    torch.testing.assert_close(yg.grad.double(), y64.grad, atol=atol, rtol=1e-2)
    assert not y.requires_grad


def test_full_symmetric_kl_errors():
    a = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"shape mismatch: ref_logits has shape \(2, 4\) but logits has shape "
                                         r"\(2, 5\)"):
        full_symmetric_kl(a, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got -1.0"):
        full_symmetric_kl(a, a, temperature=-1.0)
    with pytest.raises(TypeError, match="ref_logits must be a torch.Tensor, got NoneType"):
        full_symmetric_kl(a, None)


def test_full_symmetric_kl_on_sliced_outputs():
    full, ref = torch.randn(2, 7, 19), torch.randn(2, 7, 19)
    x = full.clone().requires_grad_()
    out = full_symmetric_kl(x[:, 1:], ref[:, 1:].contiguous())  # one side flattens, the other does not
    out.sum().backward()
    y = full[:, 1:].contiguous().requires_grad_()
    out_c = full_symmetric_kl(y, ref[:, 1:])
    out_c.sum().backward()
    torch.testing.assert_close(out, out_c, atol=0, rtol=0)
    torch.testing.assert_close(x.grad[:, 1:], y.grad, atol=0, rtol=0)
