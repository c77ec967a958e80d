"""verl_ds.algos.full_kl: the full-vocabulary symmetric KL from two models' logits, and chunked from their LM-head
inputs, against float64 references built from both models' full (N, V) logits."""
import math

import pytest
import torch
from algos_refs import symmetric_kl_loop

from verl_ds.algos import full_symmetric_kl
from verl_ds.algos.full_kl import full_symmetric_kl_torch, head_symmetric_kl

# the interpreter (numpy) warns on the -inf - -inf of a masked vocabulary entry, which the kernel then selects away
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _reference(h, w, b, g, u, c, t, mask):
    """float64: full logits of both models, J = 0.5 sum_v (p_v - q_v)(log p_v - log q_v), masked token mean."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    x = torch.nn.functional.linear(h64, w64, b64) / t
    y = torch.nn.functional.linear(g.double(), u.double(), c.double() if c is not None else None) / t
    lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    d = torch.where(torch.isfinite(lp) & torch.isfinite(lq), lp - lq, torch.zeros_like(lp))  # 0 mass in both
    kl = 0.5 * ((lp.exp() - lq.exp()) * d).sum(-1)
    loss = (kl * mask).sum() / mask.sum().clamp(min=1)
    grads = torch.autograd.grad(loss, [h64, w64] + ([b64] if b64 is not None else []))
    return kl.detach(), loss.detach(), grads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("n,chunk,backend", [(1, 4, "torch"), (13, 4, "torch"), (13, None, "torch"), (13, 4, "triton")])
@pytest.mark.parametrize("with_bias", [False, True])
def test_value_and_gradient_match_float64_full_logits(monkeypatch, dtype, tol, n, chunk, backend, with_bias):
    # triton: the kernel the CUDA dispatch picks, here in Triton's interpreter (tests/conftest.py sets it)
    monkeypatch.setenv("VERL_DS_KERNELS", backend)
    gen = torch.Generator().manual_seed(n * 7 + with_bias)
    hdim, v, t = 16, 37, 0.7  # the vocabulary is no multiple of the chunk
    h = torch.randn(n, hdim, generator=gen).to(dtype)
    g = (h.float() + 0.3 * torch.randn(n, hdim, generator=gen)).to(dtype)  # the reference's own hidden states
    w = (0.5 * torch.randn(v, hdim, generator=gen)).to(dtype)
    u = (w.float() + 0.2 * torch.randn(v, hdim, generator=gen)).to(dtype)
    b = c = None
    if with_bias:  # vocabulary entry 3 masked in both models (a -inf bias)
        b = torch.randn(v, generator=gen).to(dtype)
        b[3] = float("-inf")
        c = (b.float() + 0.1 * torch.randn(v, generator=gen)).to(dtype)
    mask = torch.ones(n)
    if n > 3:
        mask[2:5] = 0  # masked tokens: no gradient reaches their hidden states
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = b.clone().requires_grad_() if b is not None else None
    kl = head_symmetric_kl(hh, ww, g, u, bias=bb, ref_bias=c, temperature=t, chunk_rows=chunk)
    assert kl.dtype == torch.float32 and kl.shape == (n,)
    loss = (kl * mask).sum() / mask.sum()
    loss.backward()
    kl_ref, loss_ref, grads = _reference(h, w, b, g, u, c, t, mask)
    if dtype == torch.bfloat16:  # bf16 logits are rounded before the fp32 softmax: a few % of the largest value
        assert (kl.double() - kl_ref).abs().max().item() <= tol * kl_ref.abs().max().item()
    else:
        torch.testing.assert_close(kl.double(), kl_ref, atol=1e-6, rtol=tol)
    got = [hh.grad, ww.grad] + ([bb.grad] if bb is not None else [])
    for a, e in zip(got, grads):
        assert a.dtype == dtype and a.shape == e.shape
        scale = e.abs().max().item() + 1e-12
        assert (a.double() - e).abs().max().item() <= tol * scale + 1e-7
    if n > 3:
        assert hh.grad[2:5].float().abs().max() == 0


def test_identical_models_give_zero_and_no_gradient_into_the_reference():
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=gen), torch.randn(11, 8, generator=gen)
    g, u = h.clone().requires_grad_(), w.clone().requires_grad_()
    kl = head_symmetric_kl(h.requires_grad_(), w, g, u, chunk_rows=4)
    assert kl.abs().max().item() < 1e-6
    kl.sum().backward()
    assert g.grad is None and u.grad is None and h.grad is not None


def test_bad_shapes_are_refused_naming_the_argument():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="same tokens"):
        head_symmetric_kl(h, w, torch.randn(3, 8), w)
    with pytest.raises(ValueError, match="share the vocabulary"):
        head_symmetric_kl(h, w, h, torch.randn(9, 8))
    with pytest.raises(ValueError, match="chunk_rows"):
        head_symmetric_kl(h, w, h, w, chunk_rows=0)


# --- from logits -----------------------------------------------------------------------------------

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
