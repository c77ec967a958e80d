"""verl_ds.algos.fused_lm_head.fused_linear_logprobs: log-probs and entropy from hidden states and the LM-head
weight without an (N, V) tensor, against float64 references (the logits built in float64, then a plain loop),
the logits path (``logprobs_and_entropy(hidden @ weight.T)``) and hand-computed values; forward and gradients."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from algos_refs import logprob_entropy_loop
from verl_ds.algos import logprobs_and_entropy
from verl_ds.algos.fused_lm_head import fused_linear_logprobs


@pytest.fixture(autouse=True)
def _one_thread():
    # small tensors: one intra-op thread (OpenMP spin-waits slow two threads down on a loaded machine)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _inputs(n, h, v, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h) * 2).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, labels


def _ref64(hidden, weight, bias, labels, t):
    """float64 logits from the same inputs; log-probs/entropy by the float64 loop, gradients by autograd on
    the naive float64 formula."""
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_() if bias is not None else None
    logits = h @ w.T + (b if b is not None else 0)
    lp_loop, ent_loop = logprob_entropy_loop(logits, labels, t)
    ls = torch.log_softmax(logits / t, -1)
    lp, ent = ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(ls.exp() * ls).sum(-1)
    torch.testing.assert_close(lp.detach(), lp_loop)  # the autograd formula is the loop's
    torch.testing.assert_close(ent.detach(), ent_loop)
    return lp, ent, [x for x in (h, w, b) if x is not None]


def _grads(params, lp, ent, g_lp, g_ent):
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None else 0)
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t", [1.0, 0.6])
def test_fp32_forward_and_gradients_match_float64_and_the_logits_path(bias, t):
    hidden, weight, b, labels = _inputs(37, 16, 301, bias=bias)  # V=301: no chunk divides it
    params = [x for x in (hidden, weight, b) if x is not None]
    lp, ent = fused_linear_logprobs(hidden, weight, labels, t, b, chunk_rows=8, vocab_chunk=64)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (37,)
    r_lp, r_ent, r_params = _ref64(hidden, weight, b, labels, t)
    torch.testing.assert_close(lp.double(), r_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), atol=1e-5, rtol=1e-5)
    g_lp, g_ent = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    got = _grads(params, lp, ent, g_lp.float(), g_ent.float())
    want = _grads(r_params, r_lp, r_ent, g_lp, g_ent)
    for a, w in zip(got, want):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-4)
    # and the unfused logits path through verl_ds's one-pass log-prob
    logits = hidden @ weight.T + (b if b is not None else 0)
    u_lp, u_ent = logprobs_and_entropy(logits, labels, t)
    torch.testing.assert_close(lp, u_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, u_ent, atol=1e-5, rtol=1e-5)
    for a, u in zip(got, _grads(params, u_lp, u_ent, g_lp.float(), g_ent.float())):
        torch.testing.assert_close(a, u, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_as_close_to_float64_as_the_logits_path(bias):
    hidden, weight, b, labels = _inputs(33, 32, 257, dtype=torch.bfloat16, bias=bias, seed=1)
    params = [x for x in (hidden, weight, b) if x is not None]
    lp, ent = fused_linear_logprobs(hidden, weight, labels, 0.8, b, chunk_rows=16, vocab_chunk=100)
    assert lp.dtype == torch.float32
    r_lp, r_ent, r_params = _ref64(hidden, weight, b, labels, 0.8)
    logits = hidden @ weight.T + (b if b is not None else 0)  # rounded to bf16, as a bf16 model computes them
    u_lp, u_ent = logprobs_and_entropy(logits, labels, 0.8)
    g_lp, g_ent = torch.randn(33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    got = _grads(params, lp, ent, g_lp.float(), g_ent.float())
    unf = _grads(params, u_lp, u_ent, g_lp.float(), g_ent.float())
    want = _grads(r_params, r_lp, r_ent, g_lp, g_ent)
    for name, ours, logits_path, ref in [("lp", lp, u_lp, r_lp), ("ent", ent, u_ent, r_ent)] + [
            (f"grad{i}", a, u, w) for i, (a, u, w) in enumerate(zip(got, unf, want))]:
        scale = ref.detach().abs().max().item()
        err = (ours.double() - ref.detach()).abs().max().item()
        err_logits_path = (logits_path.double() - ref.detach()).abs().max().item()
        # bf16 tolerance: the logits themselves are rounded to 8 bits; the fused path is no worse than the unfused
        assert err <= max(1.5 * err_logits_path, 2e-2 * scale), (name, err, err_logits_path)
        assert err <= 5e-2 * max(scale, 1.0), (name, err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_intra_op_threads_agree_with_one_and_float64(dtype):
    hidden, weight, b, labels = _inputs(29, 8, 97, dtype=dtype, bias=True, seed=5)
    torch.set_num_threads(2)  # the fixture restores one thread
    lp, ent = fused_linear_logprobs(hidden, weight, labels, 0.9, b, chunk_rows=4, vocab_chunk=10)
    got = _grads([hidden, weight, b], lp, ent, torch.ones(29), torch.full((29,), -0.5))
    torch.set_num_threads(1)
    lp1, ent1 = fused_linear_logprobs(hidden, weight, labels, 0.9, b, chunk_rows=4, vocab_chunk=10)
    one = _grads([hidden, weight, b], lp1, ent1, torch.ones(29), torch.full((29,), -0.5))
    torch.testing.assert_close(lp, lp1, atol=1e-6, rtol=0)  # the same tiles; only torch's intra-op threads differ
    torch.testing.assert_close(ent, ent1, atol=1e-6, rtol=0)
    for a, c in zip(got, one):
        torch.testing.assert_close(a, c, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    r_lp, r_ent, r_params = _ref64(hidden, weight, b, labels, 0.9)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(lp.double(), r_lp.detach(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        want = _grads(r_params, r_lp, r_ent, torch.ones(29, dtype=torch.float64), torch.full((29,), -0.5,
                                                                                           dtype=torch.float64))
        for a, w in zip(got, want):
            torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-4)


def test_hand_computed_two_token_vocabulary():
    # logits [0, ln 3] -> p = [1/4, 3/4]; at t = 2 the logits halve: p = [1, sqrt 3] / (1 + sqrt 3)
    hidden = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[0.0], [math.log(3.0)]])
    lp, ent = fused_linear_logprobs(hidden, weight, torch.tensor([1, 0]), vocab_chunk=1)
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.25)], abs=1e-6)
    assert ent.tolist() == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))] * 2, abs=1e-6)
    lp2, _ = fused_linear_logprobs(hidden, weight, torch.tensor([1, 0]), temperature=2.0)
    s3 = math.sqrt(3.0)
    assert lp2.tolist() == pytest.approx([math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))], abs=1e-6)


@pytest.mark.parametrize("n,v,rows,vchunk", [(1, 7, 1, 3), (5, 1, 2, 4), (9, 50, 4, 50), (9, 50, 100, 7)])
def test_awkward_sizes(n, v, rows, vchunk):
    hidden, weight, b, labels = _inputs(n, 4, v, bias=True, seed=n + v)
    lp, ent = fused_linear_logprobs(hidden, weight, labels, 1.3, b, chunk_rows=rows, vocab_chunk=vchunk)
    r_lp, r_ent, r_params = _ref64(hidden, weight, b, labels, 1.3)
    torch.testing.assert_close(lp.double(), r_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), atol=1e-5, rtol=1e-5)
    got = _grads([hidden, weight, b], lp, ent, torch.ones(n), torch.ones(n))
    want = _grads(r_params, r_lp, r_ent, torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64))
    for a, w in zip(got, want):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-4)


def test_ignore_index_gives_zero_logprob_and_no_gradient_through_it():
    hidden, weight, _, labels = _inputs(6, 8, 40, seed=3)
    labels[1] = labels[4] = -100
    lp, ent = fused_linear_logprobs(hidden, weight, labels, want_entropy=False, vocab_chunk=16)
    assert ent is None and lp[1] == 0 and lp[4] == 0
    keep = labels != -100
    r_lp, _, r_params = _ref64(hidden, weight, None, torch.where(keep, labels, 0), 1.0)
    torch.testing.assert_close(lp[keep].double(), r_lp[keep].detach(), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(lp.sum(), [hidden, weight])
    want = torch.autograd.grad(r_lp[keep].sum(), r_params)
    assert got[0][1].abs().max() == 0 and got[0][4].abs().max() == 0
    for a, w in zip(got, want):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-4)


def test_masked_vocabulary_entries_with_minus_inf_bias_stay_finite():
    hidden, weight, _, labels = _inputs(5, 4, 30, seed=4)
    bias = torch.zeros(30)
    bias[10:20] = float("-inf")  # a whole vocabulary chunk masked out
    labels = labels % 10
    lp, ent = fused_linear_logprobs(hidden, weight, labels, bias=bias, vocab_chunk=10)
    logits = (hidden @ weight.T).double()[:, torch.cat([torch.arange(10), torch.arange(20, 30)])]
    r_lp, r_ent = logprob_entropy_loop(logits, labels)
    torch.testing.assert_close(lp.double(), r_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, atol=1e-5, rtol=1e-5)
    g_h, g_w = torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight])
    assert torch.isfinite(g_h).all() and torch.isfinite(g_w).all() and g_w[10:20].abs().max() == 0


def test_tied_embeddings_accumulate_both_gradients_into_one_weight():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(60, 12)
    proj = torch.nn.Linear(12, 12)
    ids, labels = torch.randint(0, 60, (20,)), torch.randint(0, 60, (20,))

    def run(fused):
        emb.zero_grad(), proj.zero_grad()
        hidden = torch.tanh(proj(emb(ids)))  # the input embedding feeds the hidden states ...
        if fused:  # ... and the same tensor is the LM head
            lp, ent = fused_linear_logprobs(hidden, emb.weight, labels, 0.9, vocab_chunk=16, chunk_rows=7)
        else:
            lp, ent = logprobs_and_entropy(hidden @ emb.weight.T, labels, 0.9)
        (lp.sum() - 0.1 * ent.sum()).backward()
        return emb.weight.grad.clone(), proj.weight.grad.clone()

    fused, plain = run(True), run(False)
    assert fused[0].abs().max() > 0
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class _LargestOutputs(TorchDispatchMode):
    """Records the element count of every tensor an aten op returns (allocations included: empty, zeros)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_n_by_v_elements_in_forward_and_backward():
    n, h, v = 256, 8, 1000  # N x V = 256000; V x H = 8000; tiles 32 x 128 = 4096
    hidden, weight, b, labels = _inputs(n, h, v, bias=True)
    with _LargestOutputs() as rec:
        lp, ent = fused_linear_logprobs(hidden, weight, labels, 0.7, b, chunk_rows=32, vocab_chunk=128)
        (lp.sum() + ent.sum()).backward()
    assert rec.largest <= v * h  # the weight gradient itself is the largest tensor
    with _LargestOutputs() as rec_logits:  # the recorder does see an (N, V) logits tensor
        lp, ent = logprobs_and_entropy(hidden @ weight.T + b, labels, 0.7)
        (lp.sum() + ent.sum()).backward()
    assert rec_logits.largest >= n * v


def test_bad_inputs_are_named():
    hidden, weight, _, labels = _inputs(4, 8, 10)
    with pytest.raises(ValueError, match=r"hidden must be \(N, H\) and weight \(V, H\)"):
        fused_linear_logprobs(hidden, weight[:, :4], labels)
    with pytest.raises(TypeError, match="share a dtype"):
        fused_linear_logprobs(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match=r"labels must have shape \(N,\) = \(4,\)"):
        fused_linear_logprobs(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match=r"token ids in \[0, V\) = \[0, 10\) or ignore_index=-100, got 10"):
        fused_linear_logprobs(hidden, weight, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(TypeError, match="labels must be an integer"):
        fused_linear_logprobs(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fused_linear_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match=r"bias must be \(10,\)"):
        fused_linear_logprobs(hidden, weight, labels, bias=torch.zeros(9))
    with pytest.raises(ValueError, match="vocab_chunk must be a positive int"):
        fused_linear_logprobs(hidden, weight, labels, vocab_chunk=0)
    with pytest.raises(TypeError, match="hidden must be a floating tensor"):
        fused_linear_logprobs(hidden.long(), weight, labels)
