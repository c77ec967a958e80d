"""verl_ds/kernels/gae.py: masked GAE (verl semantics), the scan kernel vs an explicit per-step loop."""
import pytest
import torch
from kernel_refs import DEVICE, assert_close, ref_gae

from verl_ds.kernels import gae as gae_module
from verl_ds.kernels.gae import compute_gae

TOL32 = dict(atol=2e-5, rtol=2e-5)


def _batch(n_rows, n_steps, p_valid=0.7, dtype=torch.float32):
    rewards = torch.randn(n_rows, n_steps).to(dtype)
    values = torch.randn(n_rows, n_steps).to(dtype)
    mask = torch.rand(n_rows, n_steps) < p_valid
    return rewards.to(DEVICE), values.to(DEVICE), mask.to(DEVICE)


def _check(rewards, values, mask, gamma, lam, **tol):
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    adv_ref, ret_ref = ref_gae(rewards, values, mask, gamma, lam)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape and ret.shape == rewards.shape
    assert_close(adv, adv_ref, **(tol or TOL32), what="advantages")
    assert_close(ret, ret_ref, **(tol or TOL32), what="returns")
    return adv, ret


def test_hand_computed_bridge_and_trailing_padding():
    # mask 1 0 1 0: t=3 padding (carry stays 0), t=2 terminal, t=1 bridged, t=0 bootstraps from V_2
    rewards = torch.tensor([[1.0, 100.0, 2.0, 100.0]], device=DEVICE)
    values = torch.tensor([[0.5, 100.0, 1.0, 100.0]], device=DEVICE)
    mask = torch.tensor([[True, False, True, False]], device=DEVICE)
    gamma, lam = 0.9, 0.8
    a2 = 2.0 + gamma * 0.0 - 1.0  # 1.0
    a0 = 1.0 + gamma * 1.0 - 0.5 + gamma * lam * a2  # 1.4 + 0.72 = 2.12
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    assert_close(adv, torch.tensor([[a0, a2, a2, 0.0]]), atol=1e-6, rtol=1e-6, what="advantages")
    assert_close(ret, torch.tensor([[a0 + 0.5, a2 + 100.0, a2 + 1.0, 100.0]]), atol=1e-5, rtol=1e-6, what="returns")


@pytest.mark.parametrize("n_rows,n_steps", [(3, 1), (5, 37)])
def test_vs_per_step_loop(n_rows, n_steps):
    rewards, values, mask = _batch(n_rows, n_steps)
    mask[0] = False  # an all-masked row: advantages 0, returns = values
    if n_steps > 4:
        mask[1, :4] = True
        mask[1, -6:] = False  # trailing padding
        mask[2, 10:20] = False  # a masked span inside the response
    adv, ret = _check(rewards, values, mask, 0.99, 0.95)
    assert (adv[0] == 0).all() and torch.equal(ret[0], values[0])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.0), (0.5, 0.7)])
def test_gamma_lambda_edges(gamma, lam):
    _check(*_batch(4, 23), gamma, lam)


def test_scan_carries_across_chunks(monkeypatch):
    # shrink the chunk so T = 37 takes three chunks; the carry (v+, g) must bridge them, including
    # a masked span that crosses a chunk boundary
    monkeypatch.setattr(gae_module, "SCAN_BLOCK_T_MAX", 16)
    rewards, values, mask = _batch(3, 37)
    mask[1, 12:25] = False
    mask[2, :] = False
    mask[2, 3] = True
    _check(rewards, values, mask, 0.97, 0.9)


def test_all_masked_batch():
    rewards, values, mask = _batch(6, 40)
    adv, ret = compute_gae(rewards, values, torch.zeros_like(mask), 0.99, 0.95)
    assert (adv == 0).all() and torch.equal(ret, values)


def test_bf16_and_strided_inputs():
    rewards, values, mask = _batch(4, 37, dtype=torch.bfloat16)
    _check(rewards, values, mask, 0.99, 0.95)
    # views with a row stride != T and a non-unit column stride (copied)
    wide_r, wide_v, wide_m = _batch(4, 50)
    _check(wide_r[:, 5:42], wide_v[:, 5:42], wide_m[:, 5:42], 0.99, 0.95)
    _check(wide_r.t()[:37], wide_v.t()[:37], wide_m.t()[:37], 0.99, 0.95)


def test_junk_at_masked_positions_does_not_leak():
    rewards, values, mask = _batch(2, 20)
    mask[:, 5:9] = False
    rewards[:, 5:9] = float("nan")
    values[:, 5:9] = float("inf")
    adv, _ = compute_gae(rewards, values, mask, 0.99, 0.95)
    assert torch.isfinite(adv).all()


def test_empty_batch():
    empty = torch.zeros(0, 5, device=DEVICE)
    adv, ret = compute_gae(empty, empty, empty.bool(), 0.9, 0.9)
    assert adv.shape == (0, 5) and ret.shape == (0, 5)


def test_errors_name_the_argument():
    rewards, values, mask = _batch(2, 5)
    with pytest.raises(TypeError, match="response_mask must be bool, got torch.float32"):
        compute_gae(rewards, values, mask.float(), 0.9, 0.9)
    with pytest.raises(ValueError, match=r"values must have token_rewards' shape \(2, 5\), got \(2, 4\)"):
        compute_gae(rewards, values[:, :4], mask, 0.9, 0.9)
    with pytest.raises(ValueError, match=r"token_rewards must be 2-D \(B, T\), got shape \(10,\)"):
        compute_gae(rewards.flatten(), values.flatten(), mask.flatten(), 0.9, 0.9)
    with pytest.raises(TypeError, match="token_rewards must be a float tensor, got torch.int64"):
        compute_gae(rewards.long(), values, mask, 0.9, 0.9)
    with pytest.raises(TypeError, match="gamma must be a real number, got None"):
        compute_gae(rewards, values, mask, None, 0.9)


# --- against the torch twin in verl_ds.algos (principle 12) ----------------------------------------

@pytest.mark.parametrize("n_steps", [1, 37])
def test_matches_algos_torch_path(n_steps):
    from verl_ds.algos.gae import compute_gae_torch
    rewards, values, mask = _batch(5, n_steps)
    mask[0] = False
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    adv_t, ret_t = compute_gae_torch(rewards, values, mask, 0.99, 0.95)
    assert_close(adv, adv_t, **TOL32, what="advantages vs algos")
    assert_close(ret, ret_t, **TOL32, what="returns vs algos")


def test_algos_dispatch_reaches_the_kernel(monkeypatch):
    from verl_ds.algos import gae as algos_gae
    calls = []
    monkeypatch.setattr(gae_module, "compute_gae", lambda *a, **k: calls.append(1) or compute_gae(*a, **k))
    rewards, values, mask = _batch(3, 21)
    out = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("VERL_DS_KERNELS", backend)
        out[backend] = algos_gae.compute_gae(rewards, values, mask, 0.97, 0.9)
    assert len(calls) == 1  # the triton run only
    for a, b in zip(out["triton"], out["torch"]):
        assert_close(a, b, **TOL32, what="algos triton vs torch")
