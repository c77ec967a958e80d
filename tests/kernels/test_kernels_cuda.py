"""Compiled kernels on a GPU at production sizes (benchmarks/gpu_check.sh runs these with
TRITON_INTERPRET=0); skipped without CUDA or while the interpreter is on."""
import os

import pytest
import torch
from kernel_refs import assert_close

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and TRITON_INTERPRET=0 (see benchmarks/gpu_check.sh)")


def _fp32_logprob_entropy(logits, labels):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("n_cols", [32000, 151936, 129920])
def test_logprob_large_vocab_bf16_and_memory(n_cols):
    from verl_ds.kernels.logprob import logprobs_and_entropy
    n_rows = 2048
    logits = (torch.randn(n_rows, n_cols, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, n_cols, (n_rows,), device="cuda")
    logprobs_and_entropy(logits, labels)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logprob, entropy = logprobs_and_entropy(logits, labels)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 64 * n_rows + (1 << 20), f"peak extra memory {extra} bytes is not O(N)"
    ref_lp, ref_h = _fp32_logprob_entropy(logits, labels)
    assert_close(logprob, ref_lp, atol=2e-4, rtol=1e-4, what="logprob")
    assert_close(entropy, ref_h, atol=2e-4, rtol=1e-4, what="entropy")
    assert (logprob <= 0).all()


def test_logprob_backward_bf16():
    from verl_ds.kernels.logprob import logprobs_and_entropy
    logits = (torch.randn(512, 32003, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, 32003, (512,), device="cuda")
    labels[:7] = -100
    x = logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy(x, labels, temperature=0.8)
    (lp.sum() + 0.5 * h.sum()).backward()
    x_ref = logits.float().requires_grad_()
    logp = torch.log_softmax(x_ref / 0.8, -1)
    active = (labels != -100).float()
    ref_lp = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * active
    ref_h = -(logp.exp() * logp).sum(-1) * active
    (ref_lp.sum() + 0.5 * ref_h.sum()).backward()
    assert_close(x.grad, x_ref.grad, atol=1e-3, rtol=1.6e-2, what="grad")


def test_int64_offsets_beyond_2_31_elements():
    # 16384 x 151936 = 2.5e9 elements: row offsets overflow int32
    from verl_ds.kernels.logprob import logprobs_and_entropy
    n_rows, n_cols = 16384, 151936
    logits = torch.empty(n_rows, n_cols, device="cuda", dtype=torch.bfloat16).normal_()
    labels = torch.randint(0, n_cols, (n_rows,), device="cuda")
    logprob, entropy = logprobs_and_entropy(logits, labels)
    tail = slice(n_rows - 64, n_rows)
    ref_lp, ref_h = _fp32_logprob_entropy(logits[tail], labels[tail])
    assert_close(logprob[tail], ref_lp, atol=2e-4, rtol=1e-4, what="last rows' logprob")
    assert_close(entropy[tail], ref_h, atol=2e-4, rtol=1e-4, what="last rows' entropy")


def test_symmetric_kl_large():
    from verl_ds.kernels.symkl import full_symmetric_kl
    logits = torch.randn(1024, 151936, device="cuda").bfloat16()
    ref_logits = (logits.float() + 0.5 * torch.randn_like(logits, dtype=torch.float32)).bfloat16()
    x = logits.clone().requires_grad_()
    kl = full_symmetric_kl(x, ref_logits)
    kl.sum().backward()
    x_ref = logits.float().requires_grad_()
    lp, lq = torch.log_softmax(x_ref, -1), torch.log_softmax(ref_logits.float(), -1)
    ref = 0.5 * ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1)
    ref.sum().backward()
    assert_close(kl, ref, atol=1e-4, rtol=1e-3, what="symmetric kl")
    assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1.6e-2, what="grad")


def test_gae_long_rows():
    from verl_ds.kernels.gae import compute_gae
    n_rows, n_steps, gamma, lam = 512, 4096, 0.99, 0.95
    rewards = torch.randn(n_rows, n_steps, device="cuda")
    values = torch.randn(n_rows, n_steps, device="cuda")
    lengths = torch.randint(1, n_steps + 1, (n_rows,), device="cuda")
    mask = torch.arange(n_steps, device="cuda")[None] < lengths[:, None]
    mask &= torch.rand(n_rows, n_steps, device="cuda") > 0.1  # spans inside responses
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # the per-step loop, vectorised over rows, in float64
    v_next = torch.zeros(n_rows, dtype=torch.float64, device="cuda")
    g = torch.zeros_like(v_next)
    ref = torch.empty(n_rows, n_steps, dtype=torch.float64, device="cuda")
    r64, v64 = rewards.double(), values.double()
    for t in reversed(range(n_steps)):
        m = mask[:, t]
        g = torch.where(m, r64[:, t] + gamma * v_next - v64[:, t] + gamma * lam * g, g)
        v_next = torch.where(m, v64[:, t], v_next)
        ref[:, t] = g
    assert_close(adv, ref, atol=1e-4, rtol=1e-4, what="advantages")
    assert_close(ret, ref + v64, atol=1e-4, rtol=1e-4, what="returns")
