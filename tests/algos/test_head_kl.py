"""verl_ds.algos.head_kl: the chunked full-vocabulary symmetric KL from two models' LM-head inputs, against a
float64 reference built from both models' full (N, V) logits."""
import pytest
import torch

from verl_ds.algos.head_kl import head_symmetric_kl

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
