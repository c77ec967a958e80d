"""KL estimators, a registry (``KL_KINDS``): per token from sampled log-probs (Schulman, "Approximating KL
Divergence", 2020, as verl's ``kl_penalty``), with d = log_probs - ref_log_probs: k1 = d, abs = |d|, k2 = d^2 / 2,
k3 = exp(-d) - 1 + d (>= 0, low variance), symmetric = 0.5 d (1 - exp(-d)) (>= 0, unbiased for 0.5 (KL(pi||ref) +
KL(ref||pi))), d clamped to [-20, 20] and k3 to [-10, 10] as verl. The exact full-vocabulary KL: ``full_kl``.
"""
from __future__ import annotations

import torch

from ._checks import check_float_tensor, check_same_shape
from .registry import Registry

KL_ESTIMATORS = Registry("KL kind", "kinds")
KL_KINDS = KL_ESTIMATORS.view()  # names and aliases, e.g. "k1", "kl", ...
_CLAMP_D = 20.0  # exp(20) ~ 5e8: large enough to be exact for any real policy, small enough to stay finite
_CLAMP_K3 = 10.0


def register_kl_estimator(name: str, *, aliases: tuple = ()):
    """Decorator adding a per-token KL estimator ``fn(log_probs, ref_log_probs) -> tensor`` under ``name``."""
    return KL_ESTIMATORS.register(name, aliases=aliases)


@register_kl_estimator("k1", aliases=("kl",))
def _k1(log_probs, ref_log_probs):
    return log_probs - ref_log_probs


@register_kl_estimator("abs")
def _abs(log_probs, ref_log_probs):
    return (log_probs - ref_log_probs).abs()


@register_kl_estimator("k2", aliases=("mse",))
def _k2(log_probs, ref_log_probs):
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3", aliases=("low_var_kl",))
def _k3(log_probs, ref_log_probs):
    d = (log_probs - ref_log_probs).clamp(-_CLAMP_D, _CLAMP_D)
    return (torch.exp(-d) - 1.0 + d).clamp(-_CLAMP_K3, _CLAMP_K3)


@register_kl_estimator("symmetric")
def _symmetric(log_probs, ref_log_probs):
    d = (log_probs - ref_log_probs).clamp(-_CLAMP_D, _CLAMP_D)
    # -expm1(-d) = 1 - exp(-d) without cancellation near d = 0
    return 0.5 * d * -torch.expm1(-d)


@register_kl_estimator("full_symmetric")
def _full_symmetric_sampled(log_probs, ref_log_probs):
    # only the sampled tokens' log-probs are known here (the KL controller's observation): the unbiased estimate
    return _symmetric(log_probs, ref_log_probs)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the given ``kind`` from the sampled tokens' log-probs, float32, differentiable."""
    check_float_tensor(log_probs, "log_probs")
    check_float_tensor(ref_log_probs, "ref_log_probs")
    check_same_shape(log_probs, "log_probs", ref_log_probs, "ref_log_probs")
    fn = KL_ESTIMATORS.get(kind)
    return fn(log_probs.to(torch.float32), ref_log_probs.to(torch.float32)).to(torch.float32)
