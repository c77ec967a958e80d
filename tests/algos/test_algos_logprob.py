"""verl_ds.algos log-probs and entropy: float64 loops, hand-computed cases, gradients, errors."""
import math

import pytest
import torch
from algos_refs import logprob_entropy_loop, naive_logprob_entropy

from verl_ds.algos import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from verl_ds.algos.logprob import logprobs_and_entropy_torch

# result tolerances: the computation is fp32 whatever the input, so the input's own rounding dominates
TOL = {torch.float32: 2e-5, torch.float64: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


def _inputs(shape, v, dtype=torch.float32, scale=3.0):
    logits = (torch.randn(*shape, v, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, v, shape)
    return logits, labels


def test_hand_computed_uniform_and_two_token_cases():
    # uniform over 4: log p = -log 4, H = log 4
    lp, h = logprobs_and_entropy(torch.zeros(1, 4), torch.tensor([2]))
    assert lp.item() == pytest.approx(-math.log(4), abs=1e-7)
    assert h.item() == pytest.approx(math.log(4), abs=1e-7)
    # logits (0, log 3): p = (1/4, 3/4)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    lp, h = logprobs_and_entropy(logits, torch.tensor([1]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-7)
    assert h.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-7)
    # temperature 2 on logits (0, 2 log 3) is the same distribution
    lp2, h2 = logprobs_and_entropy(torch.tensor([[0.0, 2 * math.log(3.0)]]), torch.tensor([1]), temperature=2.0)
    assert lp2.item() == pytest.approx(lp.item(), abs=1e-7)
    assert h2.item() == pytest.approx(h.item(), abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_matches_float64_loop(dtype, temperature):
    # V not a power of two; several scratch chunks with a partial last one
    logits, labels = _inputs((3, 5), 37, dtype)
    lp_ref, h_ref = logprob_entropy_loop(logits, labels, temperature)
    lp, h = logprobs_and_entropy(logits, labels, temperature=temperature)
    assert lp.dtype == torch.float32 and h.dtype == torch.float32 and lp.shape == (3, 5) and h.shape == (3, 5)
    torch.testing.assert_close(lp.double(), lp_ref, atol=TOL[dtype], rtol=1e-6)
    torch.testing.assert_close(h.double(), h_ref, atol=TOL[dtype], rtol=1e-6)
    # log-probs alone shift by the label's logit, not the max: equal up to fp32 rounding
    torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature), lp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropy_from_logits(logits, temperature), h, atol=0, rtol=0)


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 64])
def test_chunking_does_not_change_results(chunk_rows):
    logits, labels = _inputs((15,), 101)
    lp_ref, h_ref = logprob_entropy_loop(logits, labels)
    lp, h = logprobs_and_entropy_torch(logits, labels, 1.0, chunk_rows=chunk_rows)
    torch.testing.assert_close(lp.double(), lp_ref, atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(h.double(), h_ref, atol=2e-5, rtol=1e-6)


def test_v_equals_one_and_t_equals_one():
    lp, h = logprobs_and_entropy(torch.randn(2, 1, 1) * 5, torch.zeros(2, 1, dtype=torch.long))
    assert lp.shape == (2, 1)
    torch.testing.assert_close(lp, torch.zeros(2, 1), atol=1e-6, rtol=0)  # the fp32 rounding of z/t
    torch.testing.assert_close(h, torch.zeros(2, 1), atol=1e-6, rtol=0)
    lp_only = logprobs_from_logits(torch.randn(2, 1) * 5, torch.zeros(2, dtype=torch.long), temperature=0.3)
    torch.testing.assert_close(lp_only, torch.zeros(2), atol=1e-6, rtol=0)


def test_huge_logits_stay_finite_and_exact():
    logits = torch.randn(6, 50, dtype=torch.float64) * 1e4
    logits[0] = -1e4
    logits[0, 3] = 1e4
    logits[0, 7] = 1e4 - 1.0  # two near-ties at the top, everything else ~ -2e4 below
    logits = logits.float()
    labels = torch.tensor([7, 0, 1, 2, 3, 4])
    for t in (1.0, 0.7):
        lp, h = logprobs_and_entropy(logits, labels, temperature=t)
        assert torch.isfinite(lp).all() and torch.isfinite(h).all()
        lp_ref, h_ref = logprob_entropy_loop(logits, labels, t)
        # fp32 logits of 1e4 carry ~1e-3 rounding themselves; relative to them the results are exact
        torch.testing.assert_close(lp.double(), lp_ref, atol=2e-3, rtol=1e-6)
        torch.testing.assert_close(h.double(), h_ref, atol=2e-3, rtol=1e-6)
    assert lp[0].item() == pytest.approx(-math.log1p(math.exp(1 / 0.7)), abs=2e-3)


def test_masked_vocabulary_entries_give_no_nan():
    logits, labels = _inputs((4,), 12)
    logits[:, 5] = -float("inf")
    labels[labels == 5] = 0
    x = logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy(x, labels)
    (lp.sum() + h.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(h).all() and torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[:, 5], torch.zeros(4))
    lp_ref, h_ref = logprob_entropy_loop(logits.masked_fill(logits == -float("inf"), -1e30), labels)
    torch.testing.assert_close(h.double(), h_ref, atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_match_autograd_of_the_naive_formula(dtype, temperature):
    logits, labels = _inputs((2, 9), 53, dtype)
    w_lp, w_h = torch.randn(2, 9), torch.randn(2, 9)
    x = logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy(x, labels, temperature)
    ((w_lp * lp).sum() + (w_h * h).sum()).backward()
    x64 = logits.detach().double().requires_grad_()
    lp64, h64 = naive_logprob_entropy(x64, labels, temperature)
    ((w_lp * lp64).sum() + (w_h * h64).sum()).backward()
    assert x.grad.dtype == dtype
    # the gradient is stored in the logits' dtype: one rounding of it
    atol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=atol, rtol=1e-2)


@pytest.mark.parametrize("which", ["logprob", "entropy"])
def test_single_output_gradients(which):
    logits, labels = _inputs((11,), 30)
    x = logits.clone().requires_grad_()
    out = logprobs_from_logits(x, labels, 0.8) if which == "logprob" else entropy_from_logits(x, 0.8)
    w = torch.randn(11)
    (w * out).sum().backward()
    x64 = logits.detach().double().requires_grad_()
    lp64, h64 = naive_logprob_entropy(x64, labels, 0.8)
    (w * (lp64 if which == "logprob" else h64)).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-6, rtol=1e-4)
    # and the multi-chunk backward agrees with the one-chunk one
    y = logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy_torch(y, labels, 0.8, chunk_rows=3)
    (w * (lp if which == "logprob" else h)).sum().backward()
    torch.testing.assert_close(y.grad, x.grad, atol=1e-7, rtol=1e-5)


def test_only_one_output_used_in_the_loss():
    logits, labels = _inputs((5,), 20)
    x = logits.clone().requires_grad_()
    lp, _ = logprobs_and_entropy(x, labels)
    lp.sum().backward()
    x2 = logits.clone().requires_grad_()
    logprobs_from_logits(x2, labels).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-7, rtol=1e-6)


def test_no_logits_sized_copy_is_kept_for_backward():
    logits, labels = _inputs((64,), 1000)
    x = logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy_torch(x, labels)
    saved = [t for t in lp.grad_fn.saved_tensors if t.numel() >= x.numel()]
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()  # only the input itself


def test_empty_batch():
    lp, h = logprobs_and_entropy(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and h.shape == (0,)
    lp, h = logprobs_and_entropy(torch.zeros(2, 0, 7), torch.zeros(2, 0, dtype=torch.long))
    assert lp.shape == (2, 0)


def test_errors_name_the_argument():
    logits, labels = _inputs((2, 3), 10)
    with pytest.raises(ValueError, match=r"shape mismatch: labels has shape \(2, 4\) but logits has shape "
                                         r"\(2, 3, 10\); labels must have shape logits.shape\[:-1\] = \(2, 3\)"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, V\) = \[0, 10\), got 10"):
        logprobs_and_entropy(logits, labels.masked_fill(labels == labels[0, 0], 10))
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, V\) = \[0, 10\), got -1"):
        logprobs_from_logits(logits, labels - 20)
    with pytest.raises(TypeError, match="labels must be an integer .* got dtype torch.float32"):
        logprobs_from_logits(logits, labels.float())
    with pytest.raises(TypeError, match="logits must be a floating tensor .* got dtype torch.int64"):
        logprobs_from_logits(labels, labels)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        entropy_from_logits([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"logits must have shape \(\.\.\., V\) with V >= 1, got shape \(2, 0\)"):
        entropy_from_logits(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got 0.0"):
        entropy_from_logits(logits, temperature=0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got nan"):
        entropy_from_logits(logits, temperature=float("nan"))
    with pytest.raises(TypeError, match="temperature must be a real number, got str"):
        logprobs_and_entropy(logits, labels, temperature="1")


def test_sliced_model_output_is_not_copied():
    # logits[:, :-1] of a (B, T, V) output cannot be flattened to (N, V) without a copy: it is walked in place
    full = torch.randn(3, 9, 41)
    labels = torch.randint(0, 41, (3, 8))
    x = full.clone().requires_grad_()
    sliced = x[:, :-1]
    lp, h = logprobs_and_entropy(sliced, labels, 0.9)
    saved = lp.grad_fn.next_functions[0][0].saved_tensors[0]
    assert saved.data_ptr() == x.data_ptr() and saved.shape == (3, 8, 41)
    w1, w2 = torch.randn(3, 8), torch.randn(3, 8)
    ((w1 * lp).sum() + (w2 * h).sum()).backward()
    y = full[:, :-1].contiguous().requires_grad_()
    lp_c, h_c = logprobs_and_entropy(y, labels, 0.9)
    ((w1 * lp_c).sum() + (w2 * h_c).sum()).backward()
    # equal up to the last bit of a vectorised exp2 (its tail lanes fall elsewhere in another layout)
    torch.testing.assert_close(lp, lp_c, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(h, h_c, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(x.grad[:, :-1], y.grad, atol=1e-8, rtol=1e-6)
    assert torch.equal(x.grad[:, -1], torch.zeros(3, 41))


def test_log_prob_of_a_very_unlikely_label():
    logits = torch.randn(5, 40)
    labels = torch.randint(0, 40, (5,))
    logits[1, (labels[1] + 1) % 40] = 200.0
    logits[3, labels[3]] = -150.0
    x = logits.clone().requires_grad_()
    lp = logprobs_from_logits(x, labels)
    assert torch.isfinite(lp).all()
    lp_ref, _ = logprob_entropy_loop(logits, labels)
    torch.testing.assert_close(lp.double(), lp_ref, atol=2e-5, rtol=1e-6)
    lp.sum().backward()
    x64 = logits.double().requires_grad_()
    naive_logprob_entropy(x64, labels)[0].sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-6, rtol=1e-4)
    # a label on a masked (-inf) vocabulary entry has log-prob -inf, not NaN
    masked = logits.clone()
    masked[0, labels[0]] = -float("inf")
    assert logprobs_from_logits(masked, labels)[0].item() == -float("inf")
