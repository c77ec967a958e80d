"""Slow, obviously-correct float64 references for the kernel tests, and one verbose allclose."""
from __future__ import annotations

import os

import torch

# The kernel tests run on CPU tensors in Triton's interpreter, and on CUDA tensors when
# benchmarks/gpu_check.sh runs them with TRITON_INTERPRET=0 on a GPU machine.
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and torch.cuda.is_available() else "cpu"

# forward and gradient tolerances per input dtype (the kernels compute in fp32; bf16/fp16
# gradients are rounded once when stored)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-4, rtol=2e-4),
       torch.float16: dict(atol=2e-4, rtol=2e-4)}
GRAD_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-4), torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2),
            torch.float16: dict(atol=1e-4, rtol=2e-3)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """allclose that reports the mismatch count, the worst offenders and NaN/inf disagreement."""
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    same_nonfinite = (actual.isnan() == expected.isnan()).all() and (actual.isinf() == expected.isinf()).all()
    assert same_nonfinite, f"{what}: NaN/inf positions differ: got {actual}, expected {expected}"
    finite = expected.isfinite()
    err = (actual - expected).abs().where(finite, torch.zeros_like(actual))
    bad = err > atol + rtol * expected.abs().where(finite, torch.zeros_like(actual))
    if bad.any():
        idx = bad.flatten().nonzero().flatten()[:5]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements differ (atol={atol}, rtol={rtol}); max abs err "
            f"{err.max().item():.3g}; first at flat indices {idx.tolist()}: got {actual.flatten()[idx].tolist()}, "
            f"expected {expected.flatten()[idx].tolist()}")


def ref_logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                        ignore_index: int = -100):
    """log_softmax + gather and -sum p log p in float64; 0 on ignored rows."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    active = labels != ignore_index
    logprob = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)  # 0 log 0 = 0 at -inf logits
    zero = torch.zeros_like(logprob)
    return torch.where(active, logprob, zero), torch.where(active, entropy, zero)


def ref_symmetric_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0):
    """1/2 (KL(p||q) + KL(q||p)) as two explicit sums over the vocabulary, float64."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    logq = torch.log_softmax(ref_logits.double() / temperature, dim=-1)
    p, q = logp.exp(), logq.exp()
    return 0.5 * ((p * (logp - logq)).sum(-1) + (q * (logq - logp)).sum(-1))


def ref_gae(token_rewards, values, response_mask, gamma: float, lam: float):
    """verl's masked GAE as an explicit per-step Python loop in float64."""
    n_rows, n_steps = token_rewards.shape
    r, v, m = token_rewards.double().cpu(), values.double().cpu(), response_mask.cpu()
    adv = torch.zeros(n_rows, n_steps, dtype=torch.float64)
    for b in range(n_rows):
        v_next, g = 0.0, 0.0
        for t in reversed(range(n_steps)):
            if m[b, t]:
                g = r[b, t].item() + gamma * v_next - v[b, t].item() + gamma * lam * g
                v_next = v[b, t].item()
            adv[b, t] = g
    return adv, adv + v

