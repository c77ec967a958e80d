"""verl_ds/kernels/logprob.py: fused log-prob + entropy vs float64 log_softmax + gather, forward and backward."""
import pytest
import torch
from kernel_refs import DEVICE, GRAD_TOL, TOL, assert_close, ref_logprob_entropy

from verl_ds.kernels.logprob import logprobs_and_entropy


def _inputs(n_rows, n_cols, dtype=torch.float32, scale=3.0, n_ignored=1):
    logits = (torch.randn(n_rows, n_cols) * scale).to(dtype).to(DEVICE)
    labels = torch.randint(0, n_cols, (n_rows,))
    labels[:n_ignored] = -100
    return logits, labels.to(DEVICE)


def _check(logits, labels, temperature=1.0, compute_entropy=True, w_entropy=0.7):
    """Forward and the gradient of sum(w1 * logprob + w2 * entropy) against the float64 reference."""
    dtype = logits.dtype
    x = logits.clone().requires_grad_()
    logprob, entropy = logprobs_and_entropy(x, labels, temperature=temperature, compute_entropy=compute_entropy)
    x_ref = logits.detach().double().requires_grad_()
    logprob_ref, entropy_ref = ref_logprob_entropy(x_ref, labels, temperature)
    assert logprob.dtype == torch.float32 and logprob.shape == labels.shape
    assert_close(logprob, logprob_ref, **TOL[dtype], what="logprob")
    assert (logprob <= 0).all()
    w = torch.randn(labels.shape[0], device=logits.device)
    loss, loss_ref = (w * logprob).sum(), (w.double() * logprob_ref).sum()
    if compute_entropy:
        assert_close(entropy, entropy_ref, **TOL[dtype], what="entropy")
        assert (entropy >= 0).all()
        loss, loss_ref = loss + w_entropy * (w * entropy).sum(), loss_ref + w_entropy * (w.double() * entropy_ref).sum()
    else:
        assert entropy is None
    loss.backward()
    loss_ref.backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, x_ref.grad, **GRAD_TOL[dtype], what="grad logits")
    assert (x.grad[labels == -100] == 0).all()


@pytest.mark.parametrize("n_rows,n_cols", [(7, 1), (9, 1000), (3, 32003)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_forward_backward_vs_float64(n_rows, n_cols, temperature):
    _check(*_inputs(n_rows, n_cols), temperature=temperature)


@pytest.mark.parametrize("n_rows,n_cols", [(9, 1000), (2, 32003)])
def test_bf16_forward_backward(n_rows, n_cols):
    _check(*_inputs(n_rows, n_cols, torch.bfloat16), temperature=1.3)


def test_fp16_forward_and_backward():
    _check(*_inputs(9, 1000, torch.float16), temperature=0.9)


def test_without_entropy_and_entropy_only_gradient():
    logits, labels = _inputs(6, 517)
    _check(logits, labels, compute_entropy=False)
    x = logits.clone().requires_grad_()
    _, entropy = logprobs_and_entropy(x, labels)
    entropy.sum().backward()  # the log-prob output gets no gradient at all
    x_ref = logits.double().requires_grad_()
    ref_logprob_entropy(x_ref, labels)[1].sum().backward()
    assert_close(x.grad, x_ref.grad, **GRAD_TOL[torch.float32], what="entropy-only grad")


def test_large_logits_stay_finite_and_nonpositive():
    # magnitude 1e4: a naive exp overflows; the entropy's sum p*x would cancel two ~1e4 numbers
    logits, labels = _inputs(5, 1000, scale=1e4, n_ignored=0)
    labels[0] = logits[0].argmax()  # the top token: log-prob ~ 0 from below
    x = logits.clone().requires_grad_()
    logprob, entropy = logprobs_and_entropy(x, labels)
    logprob_ref, entropy_ref = ref_logprob_entropy(logits, labels)
    assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()
    assert (logprob <= 0).all() and (entropy >= 0).all()
    assert_close(logprob, logprob_ref, atol=1e-3, rtol=1e-6, what="logprob at 1e4")
    assert_close(entropy, entropy_ref, atol=1e-4, rtol=1e-4, what="entropy at 1e4")
    (logprob.sum() + entropy.sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_logprob_never_above_zero_on_peaked_rows():
    # one dominant logit per row: p(top) rounds to 1 and x_y - lse sits at the rounding edge
    logits = torch.randn(64, 333, device=DEVICE)
    logits[:, 7] = torch.linspace(20, 120, 64, device=DEVICE)
    labels = torch.full((64,), 7, device=DEVICE)
    logprob, _ = logprobs_and_entropy(logits, labels)
    assert (logprob <= 0).all()
    assert_close(logprob, ref_logprob_entropy(logits, labels)[0], atol=1e-6, rtol=0, what="peaked logprob")


def test_all_rows_ignored_cost_nothing_and_get_zero():
    logits, labels = _inputs(4, 1000, n_ignored=4)
    x = logits.clone().requires_grad_()
    logprob, entropy = logprobs_and_entropy(x, labels)
    assert (logprob == 0).all() and (entropy == 0).all()
    (logprob.sum() + entropy.sum()).backward()
    assert (x.grad == 0).all()


def test_custom_ignore_index_and_edge_labels():
    logits, labels = _inputs(5, 301, n_ignored=0)
    labels[0], labels[1], labels[2] = 0, 300, 7
    x = logits.clone().requires_grad_()
    logprob, entropy = logprobs_and_entropy(x, labels, ignore_index=7)
    active = labels != 7
    ref = ref_logprob_entropy(logits, labels, ignore_index=7)
    assert_close(logprob, ref[0], **TOL[torch.float32], what="logprob")
    assert logprob[2] == 0 and entropy[2] == 0 and active.sum() == 4


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the masked-off 0 * -inf
def test_row_strided_view_and_masked_vocabulary():
    # a column slice of a wider tensor (row stride != V), and -inf logits (top-k/vocab masking)
    wide = torch.randn(6, 1200, device=DEVICE)
    logits = wide[:, 100:1100]
    logits[:, 500:700] = float("-inf")
    labels = torch.randint(0, 500, (6,), device=DEVICE)
    _check(logits, labels)


def test_errors_name_the_argument():
    logits, labels = _inputs(3, 10)
    with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16, got torch.int64"):
        logprobs_and_entropy(logits.long(), labels)
    with pytest.raises(ValueError, match=r"logits must be 2-D \(N, V\), got shape \(3, 10, 1\)"):
        logprobs_and_entropy(logits[..., None], labels)
    with pytest.raises(TypeError, match="labels must be int64, got torch.int32"):
        logprobs_and_entropy(logits, labels.int())
    with pytest.raises(ValueError, match=r"labels must have shape \(3,\)"):
        logprobs_and_entropy(logits, labels[:2])
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"labels must be in \[0, 10\) or equal ignore_index=-100, got 10"):
            logprobs_and_entropy(logits, torch.tensor([1, 10, 2]))
    with pytest.raises(ValueError, match="temperature must be a positive finite float, got 0.0"):
        logprobs_and_entropy(logits, labels, temperature=0.0)
    with pytest.raises(TypeError, match="temperature must be a positive float, got str"):
        logprobs_and_entropy(logits, labels, temperature="1")


def test_empty_batch():
    logprob, entropy = logprobs_and_entropy(torch.zeros(0, 50, device=DEVICE), torch.zeros(0, dtype=torch.long,
                                                                                          device=DEVICE))
    assert logprob.shape == (0,) and entropy.shape == (0,)


# --- against the torch twin in verl_ds.algos (principle 12) ----------------------------------------

@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.7)])
def test_matches_algos_torch_path(dtype, temperature):
    from verl_ds.algos.logprob import logprobs_and_entropy_torch
    logits, labels = _inputs(11, 1003, dtype, n_ignored=0)
    x = logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy(x, labels, temperature)
    x_t = logits.clone().requires_grad_()
    lp_t, h_t = logprobs_and_entropy_torch(x_t, labels, temperature)
    assert_close(lp, lp_t, **TOL[dtype], what="logprob vs algos")
    assert_close(h, h_t, **TOL[dtype], what="entropy vs algos")
    w = torch.randn(2, 11, device=DEVICE)
    ((w[0] * lp).sum() + (w[1] * h).sum()).backward()
    ((w[0] * lp_t).sum() + (w[1] * h_t).sum()).backward()
    assert_close(x.grad, x_t.grad, **GRAD_TOL[dtype], what="grad vs algos")


def test_algos_dispatch_reaches_the_kernel(monkeypatch):
    # verl_ds.algos routes to this kernel under VERL_DS_KERNELS=triton and to its torch path under torch
    from verl_ds.algos import logprob as algos_logprob
    from verl_ds.kernels import logprob as kernel_module
    calls = []
    monkeypatch.setattr(kernel_module, "logprobs_and_entropy",
                        lambda *a, **k: calls.append(1) or logprobs_and_entropy(*a, **k))
    logits = _inputs(12, 77, n_ignored=0)[0].view(3, 4, 77)
    labels = torch.randint(0, 77, (3, 4), device=DEVICE)
    out = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("VERL_DS_KERNELS", backend)
        out[backend] = algos_logprob.logprobs_and_entropy(logits, labels, temperature=0.9)
    assert len(calls) == 1  # the triton run only
    for a, b in zip(out["triton"], out["torch"]):
        assert a.shape == (3, 4)
        assert_close(a, b, **TOL[torch.float32], what="algos triton vs torch")
