"""verl_ds/kernels/symkl.py: full-vocabulary symmetric KL."""
import math

import pytest
import torch
from kernel_refs import DEVICE, GRAD_TOL, TOL, assert_close, ref_symmetric_kl

from verl_ds.kernels.symkl import full_symmetric_kl

# Padding columns load -inf for both rows; the interpreter (numpy) warns on the -inf - -inf it then
# masks away. Compiled kernels compute the same select silently.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _pair(n_rows, n_cols, dtype=torch.float32, scale=2.0):
    logits = (torch.randn(n_rows, n_cols) * scale).to(dtype).to(DEVICE)
    ref_logits = (logits.float().cpu() + torch.randn(n_rows, n_cols) * scale).to(dtype).to(DEVICE)
    return logits, ref_logits


def _check_symkl(logits, ref_logits, temperature=1.0):
    dtype = logits.dtype
    x = logits.clone().requires_grad_()
    y = ref_logits.clone().requires_grad_()  # must receive no gradient
    kl = full_symmetric_kl(x, y, temperature)
    x_ref = logits.detach().double().requires_grad_()
    kl_ref = ref_symmetric_kl(x_ref, ref_logits, temperature)
    assert kl.dtype == torch.float32 and kl.shape == (logits.shape[0],)
    assert_close(kl, kl_ref, **TOL[dtype], what="symmetric kl")
    assert (kl >= 0).all()
    w = torch.randn(logits.shape[0], device=logits.device)
    (w * kl).sum().backward()
    (w.double() * kl_ref).sum().backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, x_ref.grad, **GRAD_TOL[dtype], what="grad logits")
    assert y.grad is None


@pytest.mark.parametrize("n_rows,n_cols", [(7, 1), (9, 1000), (2, 32003)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp32_forward_backward_vs_float64(n_rows, n_cols, temperature):
    _check_symkl(*_pair(n_rows, n_cols), temperature)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_backward(dtype):
    _check_symkl(*_pair(9, 1000, dtype), 1.2)


def test_bf16_large_vocab():
    _check_symkl(*_pair(2, 32003, torch.bfloat16))


def test_hand_computed_two_token_case():
    # x = (0, 0), y = (0, log 3): p = (1/2, 1/2), q = (1/4, 3/4), d = x - y = (0, -log 3)
    # J = 1/2 sum (p - q) d = 1/2 * (-1/4)(-log 3) = log(3) / 8
    # dJ/dx_k = 1/2 (p_k (d_k - E_p[d] + 1) - q_k), E_p[d] = -log(3)/2
    x = torch.tensor([[0.0, 0.0]], device=DEVICE, requires_grad=True)
    y = torch.tensor([[0.0, math.log(3.0)]], device=DEVICE)
    kl = full_symmetric_kl(x, y)
    kl.sum().backward()
    l3 = math.log(3.0)
    expected_grad = [0.5 * (0.5 * (l3 / 2 + 1) - 0.25), 0.5 * (0.5 * (-l3 + l3 / 2 + 1) - 0.75)]
    assert_close(kl, torch.tensor([l3 / 8]), atol=1e-7, rtol=1e-6, what="J")
    assert_close(x.grad, torch.tensor([expected_grad]), atol=1e-7, rtol=1e-6, what="dJ/dx")
    assert abs(sum(expected_grad)) < 1e-12  # softmax invariance: the gradient sums to 0


def test_zero_for_equal_distributions_and_shift_invariant():
    logits = torch.randn(4, 777, device=DEVICE)
    x = logits.clone().requires_grad_()
    kl = full_symmetric_kl(x, logits + 5.0)  # same softmax
    kl.sum().backward()
    assert (kl.abs() < 1e-6).all()
    assert (x.grad.abs() < 1e-6).all()


def test_large_logits_stay_finite():
    logits, ref_logits = _pair(3, 1000, scale=1e4)
    x = logits.clone().requires_grad_()
    kl = full_symmetric_kl(x, ref_logits)
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    assert_close(kl, ref_symmetric_kl(logits, ref_logits), atol=1e-2, rtol=1e-5, what="J at 1e4")
    kl.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_symkl_errors_name_the_argument():
    logits, ref_logits = _pair(3, 10)
    with pytest.raises(ValueError, match=r"ref_logits must have the logits' shape \(3, 10\), got \(3, 11\)"):
        full_symmetric_kl(logits, torch.zeros(3, 11, device=DEVICE))
    with pytest.raises(ValueError, match=r"ref_logits must have 3 rows, got shape \(2, 10\)"):
        full_symmetric_kl(logits, ref_logits[:2])
    with pytest.raises(TypeError, match="ref_logits must be float32, bfloat16 or float16, got torch.float64"):
        full_symmetric_kl(logits, ref_logits.double())
    with pytest.raises(ValueError, match="temperature must be a positive finite float, got -1.0"):
        full_symmetric_kl(logits, ref_logits, temperature=-1.0)


# --- against the torch twins in verl_ds.algos.full_kl (principle 12) --------------------------------

@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.8)])
def test_full_symmetric_kl_matches_algos_torch_path(dtype, temperature):
    from verl_ds.algos.full_kl import full_symmetric_kl_torch
    logits, ref_logits = _pair(9, 1003, dtype)
    x = logits.clone().requires_grad_()
    x_t = logits.clone().requires_grad_()
    kl = full_symmetric_kl(x, ref_logits, temperature)
    kl_t = full_symmetric_kl_torch(x_t, ref_logits, temperature)
    assert_close(kl, kl_t, **TOL[dtype], what="symmetric kl vs algos")
    w = torch.randn(9, device=DEVICE)
    (w * kl).sum().backward()
    (w * kl_t).sum().backward()
    assert_close(x.grad, x_t.grad, **GRAD_TOL[dtype], what="grad vs algos")


def test_algos_dispatch_reaches_the_kernel(monkeypatch):
    from verl_ds.algos import full_kl as algos_kl
    from verl_ds.kernels import symkl as kernel_module
    calls = []
    monkeypatch.setattr(kernel_module, "full_symmetric_kl",
                        lambda *a, **k: calls.append(1) or full_symmetric_kl(*a, **k))
    logits, ref_logits = _pair(6, 50)
    out = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("VERL_DS_KERNELS", backend)
        out[backend] = algos_kl.full_symmetric_kl(logits.view(2, 3, 50), ref_logits.view(2, 3, 50), 1.1)
    assert len(calls) == 1  # the triton run only
    assert out["triton"].shape == (2, 3)
    assert_close(out["triton"], out["torch"], **TOL[torch.float32], what="algos triton vs torch")
