"""PPO losses (verl's ``vanilla`` policy loss and ``compute_value_loss``) and importance weights for off-policy tokens.
Each loss returns (0-d float32 loss, detached 0-d metrics): no host sync here."""
from __future__ import annotations

import numbers

import torch

from ._checks import as_bool_mask, check_float_tensor, check_positive_number, check_same_shape
from .masked import agg_loss, masked_mean

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: the ratio stays finite for any real policy drift


def _check_btensors(ref_name, ref, **others):
    check_float_tensor(ref, ref_name)
    if ref.dim() != 2:
        raise ValueError(f"{ref_name} must have shape (B, R), got shape {tuple(ref.shape)}")
    for name, t in others.items():
        check_float_tensor(t, name)
        check_same_shape(ref, ref_name, t, name)


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float = 2.0):
    """Truncated importance sampling (TIS: Yao et al. 2025, https://fengyao.notion.site/off-policy-rl; verl's
    ``tis_imp_ratio_cap``): w = min(exp(old_log_probs - rollout_log_probs), cap) per token, the trainer's over the
    sampler's probability (vLLM, a bf16 rollout). Returns (weights (B, R) without grad, 0 on padding; metrics
    is_weight_mean and is_capped_frac)."""
    m, ratio, cap = _sampler_ratio(("old_log_probs", old_log_probs), ("rollout_log_probs", rollout_log_probs),
                                   response_mask, cap, "a weight is capped at cap; below 1 every on-policy token is "
                                                       "down-weighted")
    weights = torch.where(m, ratio.clamp(max=cap), 0.0)
    return weights, {"is_weight_mean": masked_mean(weights, m), "is_capped_frac": masked_mean((ratio > cap).float(), m)}


def _sampler_ratio(new: tuple, behav: tuple, response_mask: torch.Tensor, cap: float, why_cap: str):
    """(mask, exp(new - behav) without grad (1 on padding), cap) after checking the (name, tensor) pairs and cap."""
    (new_name, new_lp), (behav_name, behav_lp) = new, behav
    _check_btensors(new_name, new_lp, **{behav_name: behav_lp})
    m = as_bool_mask(response_mask, "response_mask", new_lp.shape, new_name)
    cap = check_positive_number(cap, "cap")
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1 ({why_cap}), got {cap!r}")
    with torch.no_grad():
        # padding first: the sampler reports 0 there, and a NaN past the end must not reach a weight
        log_ratio = torch.where(m, new_lp.float() - behav_lp.float(), 0.0)
        return m, torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)), cap


def decoupled_is_weights(prox_log_probs: torch.Tensor, behav_log_probs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float = 2.0):
    """Behaviour weights of the decoupled PPO objective (AReaL: Fu et al. 2025, arXiv:2505.24298, eq. 5): w = pi_prox
    / pi_behav per token, pi_behav the sampler (``rollout_log_probs``, maybe older actors), pi_prox the actor before
    this update (``old_log_probs``): the trust region is around pi_prox, not a stale behaviour policy. A token over
    ``cap`` gets weight 0, as AReaL's ``behav_imp_weight_cap``. Returns as ``truncated_is_weights``."""
    m, ratio, cap = _sampler_ratio(("prox_log_probs", prox_log_probs), ("behav_log_probs", behav_log_probs),
                                   response_mask, cap, "tokens whose weight exceeds it are left out; below 1 on-policy "
                                                       "tokens would be")
    over = ratio > cap
    weights = torch.where(m & ~over, ratio, 0.0)
    return weights, {"is_weight_mean": masked_mean(weights, m), "is_capped_frac": masked_mean(over.float(), m)}


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "token-mean", normalizer=None,
                is_weights: torch.Tensor | None = None, max_len: int | None = None):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with dual clip (Ye et al. 2019,
    arXiv:1912.09729), as verl's ``vanilla``: rho = exp(clamp(log_probs - old_log_probs, -20, 20)), L = max(-A rho,
    -A clip(rho, 1 - low, 1 + high)), capped at -c A where A < 0 (c = clip_ratio_c; None: off). ``is_weights``
    (B, R) scale each token's loss, with no gradient. Metrics: pg_clipfrac, pg_clipfrac_lower, ppo_kl."""
    _check_btensors("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
    if is_weights is not None:
        _check_btensors("log_probs", log_probs, is_weights=is_weights)
    m = as_bool_mask(response_mask, "response_mask", log_probs.shape, "log_probs")
    low = check_positive_number(clip_ratio_low, "clip_ratio_low", allow_zero=True)
    high = check_positive_number(clip_ratio_high, "clip_ratio_high", allow_zero=True)
    if low >= 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0, got {low!r}")
    if clip_ratio_c is not None:
        if isinstance(clip_ratio_c, bool) or not isinstance(clip_ratio_c, numbers.Real) or not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be a number > 1 (or None to disable the dual clip), "
                             f"got {clip_ratio_c!r}")
    zero = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    # zero out padding first: a NaN there would otherwise reach the gradient through 0 * NaN
    log_ratio = torch.where(m, log_probs.to(torch.float32) - old_log_probs.to(torch.float32), zero)
    adv = torch.where(m, advantages.to(torch.float32), zero)
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    clipped = torch.maximum(loss1, loss2)
    if clip_ratio_c is not None:
        loss3 = -adv * float(clip_ratio_c)
        lower = (adv < 0) & (clipped > loss3)
        losses = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
    else:
        lower = torch.zeros_like(m)
        losses = clipped
    if is_weights is not None:
        losses = losses * torch.where(m, is_weights.detach().to(torch.float32), zero)
    loss = agg_loss(losses, m, loss_agg_mode, normalizer, max_len=max_len)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss2 > loss1).float(), m),
            "pg_clipfrac_lower": masked_mean(lower.float(), m),
            "ppo_kl": masked_mean(-log_ratio.detach(), m),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, cliprange_value: float | None = 0.5,
               loss_agg_mode: str = "token-mean", normalizer=None, max_len: int | None = None):
    """0.5 agg(max((V - G)^2, (V_clip - G)^2)), V_clip = V_old + clip(V - V_old, +-eps), as verl's; eps None or 0: no
    clipping (at eps = 0 the gradient would vanish where V is nearer G than V_old). Metrics: vf_clipfrac, vpred_mean."""
    _check_btensors("values", values, old_values=old_values, returns=returns)
    m = as_bool_mask(response_mask, "response_mask", values.shape, "values")
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = torch.where(m, values.to(torch.float32), zero)
    r = torch.where(m, returns.to(torch.float32), zero)
    err1 = (v - r).square()
    eps = None if cliprange_value is None else check_positive_number(cliprange_value, "cliprange_value",
                                                                     allow_zero=True)
    if eps:  # None or 0: no clipping
        v_old = torch.where(m, old_values.to(torch.float32), zero)
        v_clip = v_old + (v - v_old).clamp(-eps, eps)
        err2 = (v_clip - r).square()
        losses = torch.maximum(err1, err2)
    else:
        err2 = err1
        losses = err1
    loss = 0.5 * agg_loss(losses, m, loss_agg_mode, normalizer, max_len=max_len)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((err2 > err1).float(), m),
            "vpred_mean": masked_mean(v.detach(), m),
        }
    return loss, metrics
