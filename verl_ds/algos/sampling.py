"""DAPO's sampling-side pieces (Yu et al. 2025, arXiv:2503.14476: the soft overlong penalty, eq. 13, and dynamic
sampling's groups with signal) and evaluation estimators (pass@k of Chen et al. 2021, arXiv:2107.03374; mean@k).
"""
from __future__ import annotations

import math

import torch

from ._checks import check_float_tensor, check_positive_number, check_tensor
from .groups import check_int, group_inverse


def overlong_reward_penalty(response_length: torch.Tensor, max_new_tokens: int, overlong_buffer: int,
                            penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong penalty per sample, (B,) float32, added to the score. With L = response_length,
    L_max = max_new_tokens, C = overlong_buffer, f = penalty_factor:
        0                           for L <= L_max - C
        -f (L - (L_max - C)) / C    for L_max - C < L <= L_max   (linear from 0 down to -f)
        -f                          for L > L_max
    (C = 0: no ramp, -f only past L_max.)"""
    check_tensor(response_length, "response_length")
    if response_length.dim() != 1 or response_length.is_complex() or response_length.dtype == torch.bool:
        raise ValueError(f"response_length must be a (B,) integer or float tensor, got dtype {response_length.dtype} "
                         f"and shape {tuple(response_length.shape)}")
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1)
    overlong_buffer = check_int(overlong_buffer, "overlong_buffer")
    if overlong_buffer > max_new_tokens:
        raise ValueError(f"overlong_buffer ({overlong_buffer}) must be <= max_new_tokens ({max_new_tokens})")
    factor = check_positive_number(penalty_factor, "penalty_factor", allow_zero=True)
    length = response_length.to(torch.float64)
    if bool((length < 0).any()):  # one sync: a negative length is a caller bug
        raise ValueError(f"response_length must be >= 0, got {length.min().item()!r}")
    if overlong_buffer == 0:
        penalty = torch.where(length > max_new_tokens, -factor, 0.0)
    else:
        exceed = (length - (max_new_tokens - overlong_buffer)).clamp(min=0.0)
        penalty = (-factor * exceed / overlong_buffer).clamp(min=-factor)
    return (penalty + 0.0).to(torch.float32)  # + 0.0: -0.0 -> 0.0 below the ramp


def groups_with_signal(scores: torch.Tensor, group_index) -> torch.Tensor:
    """(B,) bool: True where the group's scores are not all equal (an all-equal group has zero GRPO advantage)."""
    check_float_tensor(scores, "scores")
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (B,), got shape {tuple(scores.shape)}")
    if not bool(torch.isfinite(scores).all()):  # one sync: NaN != NaN would look like signal
        raise ValueError("scores must be finite, got a NaN or inf")
    inverse, n_groups = group_inverse(group_index, scores.shape[0], scores.device)
    lo = torch.full((n_groups,), math.inf, dtype=scores.dtype, device=scores.device)
    hi = torch.full((n_groups,), -math.inf, dtype=scores.dtype, device=scores.device)
    lo = lo.scatter_reduce(0, inverse, scores, "amin")
    hi = hi.scatter_reduce(0, inverse, scores, "amax")
    return (hi > lo)[inverse]


def _check_nck(n, c, k) -> tuple[int, int, int]:
    n = check_int(n, "n", minimum=1)
    c = check_int(c, "c")
    k = check_int(k, "k", minimum=1)
    if c > n:
        raise ValueError(f"c (correct samples) must be <= n (samples), got c={c}, n={n}")
    if k > n:
        raise ValueError(f"k must be <= n (samples drawn), got k={k}, n={n}")
    return n, c, k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), as the stable
    product 1 - prod_(i = n-c+1..n) (1 - k / i) (no huge binomials). Requires 1 <= k <= n, 0 <= c <= n."""
    n, c, k = _check_nck(n, c, k)
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_k(n: int, c: int, k: int) -> float:
    """mean@k: the expected share of correct samples among k drawn from n (c correct), c / n for every k (= pass@1)."""
    n, c, k = _check_nck(n, c, k)
    return c / n

