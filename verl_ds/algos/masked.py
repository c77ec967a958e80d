"""Masked reductions and loss aggregation (verl's ``masked_mean``/``masked_whiten`` and ``agg_loss`` modes). Masked-out
values become 0 before anything is multiplied or summed, so a NaN in padding never reaches a result or a gradient.
"""
from __future__ import annotations

import numbers

import torch

from ._checks import as_bool_mask, check_float_tensor, check_tensor
from .registry import Registry

LOSS_AGGREGATIONS = Registry("loss_agg_mode", "modes")
LOSS_AGG_MODES = LOSS_AGGREGATIONS.view()


def register_loss_agg(name: str, *, aliases: tuple = ()):
    """Decorator adding a loss aggregation ``fn(loss_mat, response_mask, normalizer, max_len) -> 0-d`` (float32
    ``loss_mat`` with zeros outside the bool mask)."""
    return LOSS_AGGREGATIONS.register(name, aliases=aliases)


def _masked_values(x, mask):
    check_float_tensor(x, "x")
    m = as_bool_mask(mask, "mask", x.shape, "x")
    return torch.where(m, x.to(torch.float32), torch.zeros((), dtype=torch.float32, device=x.device)), m


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is true (over ``dim``, default all), float32; where
    nothing is valid the result is 0, not NaN, as in verl (and a bool mask costs no sync)."""
    xm, m = _masked_values(x, mask)
    if dim is None:
        dim = tuple(range(x.dim()))
    return xm.sum(dim=dim) / m.sum(dim=dim).clamp(min=1).to(torch.float32)


def _count_at_least_two(m: torch.Tensor, what: str) -> torch.Tensor:
    n = m.sum()
    if int(n) < 2:  # one sync; Bessel's correction is undefined below 2 samples
        raise ValueError(f"{what} needs at least 2 valid (mask=True) elements for the unbiased variance, "
                         f"got {int(n)}")
    return n.to(torch.float32)


def _centered(x, mask, what: str, unbiased: bool = True):
    """(x - mean with 0 outside the mask, mean, variance, bool mask) over the valid positions."""
    xm, m = _masked_values(x, mask)
    if unbiased:
        n = _count_at_least_two(m, what)
    else:
        n = m.sum().to(torch.float32)
        if int(n) < 1:
            raise ValueError(f"{what} needs at least 1 valid (mask=True) element, got 0")
    mean = xm.sum() / n
    centered = torch.where(m, xm - mean, torch.zeros((), dtype=torch.float32, device=x.device))
    return centered, mean, centered.square().sum() / (n - 1 if unbiased else n), m


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the valid positions (0-d float32), Bessel-corrected by default."""
    return _centered(x, mask, "masked_var", unbiased)[2]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid positions (unbiased var), float32, 0 outside the mask;
    shift_mean=False adds the mean back (scale only)."""
    centered, mean, var, m = _centered(x, mask, "masked_whiten")
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = torch.where(m, out + mean, out)
    return out


def _check_normalizer(normalizer):
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.dim() != 0:
            raise ValueError(f"normalizer must be a number or a 0-d tensor, got a tensor of shape "
                             f"{tuple(normalizer.shape)}")
        return normalizer.to(torch.float32)
    if isinstance(normalizer, bool) or not isinstance(normalizer, numbers.Real) or not normalizer > 0:
        raise ValueError(f"normalizer must be a positive number or a 0-d tensor, got {normalizer!r}")
    return float(normalizer)


def _seq_count(m, norm):
    """N_seq (sequences with a valid token) or the caller's normalizer."""
    return norm if norm is not None else (m.sum(dim=-1) > 0).sum().clamp(min=1).to(torch.float32)


@register_loss_agg("token-mean")
def _token_mean(xm, m, norm, max_len):
    return xm.sum() / (norm if norm is not None else m.sum().clamp(min=1).to(torch.float32))


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(xm, m, norm, max_len):
    return xm.sum() / _seq_count(m, norm)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(xm, m, norm, max_len):
    seq_means = xm.sum(dim=-1) / m.sum(dim=-1).clamp(min=1).to(torch.float32)  # empty rows give 0
    return seq_means.sum() / _seq_count(m, norm)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(xm, m, norm, max_len):
    return xm.sum() / (_seq_count(m, norm) * (max_len if max_len is not None else xm.shape[-1]))


def agg_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean", normalizer=None, *,
             max_len: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss X = ``loss_mat`` (B, R) over m = ``response_mask`` (B, R) into a 0-d float32 loss:
      token-mean               sum(X m) / N_tok
      seq-mean-token-sum       sum_i sum_t X m / N_seq
      seq-mean-token-mean      sum_i (sum_t X m / sum_t m) / N_seq        (GRPO)
      seq-mean-token-sum-norm  sum(X m) / (N_seq * C), C = max_len or R   (Dr.GRPO)
    ``normalizer`` replaces N_tok / N_seq: the trainer passes the mini-batch's global count, so micro-batch losses
    add up to the global mean."""
    check_float_tensor(loss_mat, "loss_mat")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must have shape (B, R), got shape {tuple(loss_mat.shape)}")
    fn = LOSS_AGGREGATIONS.get(mode)
    check_tensor(response_mask, "response_mask")
    m = as_bool_mask(response_mask, "response_mask", loss_mat.shape, "loss_mat")
    norm = _check_normalizer(normalizer)
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    xm = torch.where(m, loss_mat.to(torch.float32), torch.zeros((), dtype=torch.float32, device=loss_mat.device))
    return fn(xm, m, norm, max_len).to(torch.float32)
