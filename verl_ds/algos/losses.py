"""The PPO value loss (verl's ``compute_value_loss``); the policy losses are in ``policy_losses``, the importance
weights of off-policy tokens in ``mismatch``. Each loss returns (0-d float32 loss, detached 0-d metrics): no host
sync here."""
from __future__ import annotations

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
