"""Policy losses behind one registry (``algo.policy_loss``), in verl 0.9.1's semantics (``core_algos.py``): every
entry is ``fn(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode, normalizer, is_weights,
max_len) -> (0-d float32 loss, detached 0-d metrics pg_clipfrac, pg_clipfrac_lower, ppo_kl)``. No host sync here;
formulas, papers and clip values: docs/algorithms.md.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._checks import as_bool_mask, check_positive_number
from .advantages import resolve_loss_agg_mode
from .losses import _LOG_RATIO_CLAMP, _check_btensors
from .masked import LOSS_AGGREGATIONS, agg_loss, masked_mean
from .registry import Registry

_GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of GSPO's token-level log-ratio (above only)


@dataclass(frozen=True)
class PolicyLossParams:
    """The scalars a policy loss reads (each loss ignores the ones it has no use for: docs/algorithms.md)."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0  # vanilla's dual clip (None: off)
    tau_pos: float = 1.0  # SAPO's gate temperatures for positive / non-positive advantages
    tau_neg: float = 1.05

    def __post_init__(self):
        low = check_positive_number(self.clip_ratio_low, "clip_ratio_low", allow_zero=True)
        if low >= 1.0:
            raise ValueError(f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0, got {low!r}")
        check_positive_number(self.clip_ratio_high, "clip_ratio_high", allow_zero=True)
        c = self.clip_ratio_c
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not c > 1.0):
            raise ValueError(f"clip_ratio_c must be a number > 1 (or None to disable the dual clip), got {c!r}")
        check_positive_number(self.tau_pos, "tau_pos")
        check_positive_number(self.tau_neg, "tau_neg")


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss; ``loss_agg_mode``: what ``algo.loss_agg_mode=auto`` means with it (None: the estimator's
    convention), and with ``forces_loss_agg_mode`` the only mode it takes (it aggregates per sequence itself).
    Called with log_probs, old_log_probs, advantages, is_weights (B, R) of any float dtype (computed in float32) and
    response_mask (B, R) bool or 0/1; is_weights (no gradient) scale each token's loss."""
    name: str
    fn: Callable
    loss_agg_mode: Optional[str] = None
    forces_loss_agg_mode: bool = False

    def __call__(self, log_probs, old_log_probs, advantages, response_mask, params: PolicyLossParams | None = None,
                 loss_agg_mode: str | None = None, normalizer=None, is_weights=None, max_len: int | None = None):
        params = PolicyLossParams() if params is None else params
        if not isinstance(params, PolicyLossParams):
            raise TypeError(f"params must be a PolicyLossParams, got {type(params).__name__}")
        mode = loss_agg_mode if loss_agg_mode is not None else (self.loss_agg_mode or "token-mean")
        LOSS_AGGREGATIONS.get(mode)  # an unknown mode raises, naming the valid ones
        if self.forces_loss_agg_mode and mode != self.loss_agg_mode:
            raise ValueError(f"policy loss {self.name!r} aggregates {self.loss_agg_mode} (as verl's); got "
                             f"loss_agg_mode={mode!r}")
        return self.fn(log_probs, old_log_probs, advantages, response_mask, params, mode, normalizer, is_weights,
                       max_len)


POLICY_LOSSES = Registry("policy loss", "names")
POLICY_LOSS_NAMES = POLICY_LOSSES.view()


def register_policy_loss(name: str, *, loss_agg_mode: str | None = None, forces_loss_agg_mode: bool = False,
                         aliases: tuple = ()):
    """Decorator registering a ``PolicyLoss``'s ``fn`` under ``name``; a taken name raises."""
    if loss_agg_mode is not None:
        LOSS_AGGREGATIONS.get(loss_agg_mode)
    elif forces_loss_agg_mode:
        raise ValueError(f"policy loss {name!r}: forces_loss_agg_mode needs a loss_agg_mode")

    def add(fn):
        POLICY_LOSSES.register(name, aliases=aliases)(PolicyLoss(name, fn, loss_agg_mode, bool(forces_loss_agg_mode)))
        return fn
    return add


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as ``name``; an unknown name lists the known ones and the closest."""
    return POLICY_LOSSES.get(name)


def resolve_policy_loss_agg_mode(policy_loss: str, loss_agg_mode: str, adv_estimator: str) -> str:
    """``algo.loss_agg_mode`` for this loss: ``auto`` -> the loss's aggregation, else the estimator's; a loss that
    aggregates per sequence itself (geo_mean, sapo) refuses any other explicit mode."""
    loss = get_policy_loss(policy_loss)
    if loss_agg_mode == "auto":
        return loss.loss_agg_mode or resolve_loss_agg_mode("auto", adv_estimator)
    if loss.forces_loss_agg_mode and loss_agg_mode != loss.loss_agg_mode:
        raise ValueError(f"policy loss {policy_loss!r} aggregates {loss.loss_agg_mode} (as verl's), got "
                         f"loss_agg_mode={loss_agg_mode!r}; set it to auto or {loss.loss_agg_mode}")
    return loss_agg_mode


def _prepare(log_probs, old_log_probs, advantages, response_mask, is_weights):
    """(log_probs, log-ratio, advantages, is_weights or None) float32 with 0 on padding, and the bool mask: padding
    goes first, so a NaN there never reaches a loss or a gradient through 0 * NaN."""
    _check_btensors("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
    if is_weights is not None:
        _check_btensors("log_probs", log_probs, is_weights=is_weights)
    m = as_bool_mask(response_mask, "response_mask", log_probs.shape, "log_probs")
    zero = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    lp = torch.where(m, log_probs.to(torch.float32), zero)
    log_ratio = torch.where(m, log_probs.to(torch.float32) - old_log_probs.to(torch.float32), zero)
    adv = torch.where(m, advantages.to(torch.float32), zero)
    w = None if is_weights is None else torch.where(m, is_weights.detach().to(torch.float32), zero)
    return lp, log_ratio, adv, w, m


def _ratio(log_ratio):
    """(clamped log-ratio, ratio): +-20 keeps exp finite for any real policy drift."""
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def _metrics(m, clipped, lower, log_ratio):
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    with torch.no_grad():
        return {"pg_clipfrac": zero if clipped is None else masked_mean(clipped.float(), m),
                "pg_clipfrac_lower": zero if lower is None else masked_mean(lower.float(), m),
                "ppo_kl": masked_mean(-log_ratio.detach(), m)}


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "token-mean", normalizer=None,
                is_weights: torch.Tensor | None = None, max_len: int | None = None):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with dual clip (Ye et al. 2019,
    arXiv:1912.09729), verl's ``vanilla``: rho = exp(clamp(log_probs - old_log_probs, -20, 20)), L = max(-A rho,
    -A clip(rho, 1 - low, 1 + high)), capped at -c A where A < 0 (c = clip_ratio_c; None: off). ``is_weights``
    (B, R) scale each token's loss, with no gradient. Metrics: pg_clipfrac, pg_clipfrac_lower, ppo_kl."""
    params = PolicyLossParams(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return get_policy_loss("vanilla")(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode,
                                      normalizer, is_weights, max_len)


@register_policy_loss("vanilla")
def _vanilla(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode, normalizer, is_weights,
             max_len):
    _, log_ratio, adv, w, m = _prepare(log_probs, old_log_probs, advantages, response_mask, is_weights)
    log_ratio, ratio = _ratio(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    lower = None
    losses = clipped
    if params.clip_ratio_c is not None:
        loss3 = -adv * float(params.clip_ratio_c)
        lower = (adv < 0) & (clipped > loss3)
        losses = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
    if w is not None:
        losses = losses * w
    loss = agg_loss(losses, m, loss_agg_mode, normalizer, max_len=max_len)
    return loss, _metrics(m, loss2 > loss1, lower, log_ratio)


# GSPO (Zheng et al. 2025, arXiv:2507.18071, and its GSPO-token variant): s_i = exp(mean_t log-ratio) per sequence;
# s_i,t = sg[s_i] pi / sg[pi] has s_i's value but a per-token gradient. Its clip range is ~1e-4 wide (paper: 3e-4 /
# 4e-4), not PPO's 0.2. verl defaults the aggregation to seq-mean-token-mean but takes any mode, so do we.
@register_policy_loss("gspo", loss_agg_mode="seq-mean-token-mean")
def _gspo(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode, normalizer, is_weights,
          max_len):
    lp, log_ratio, adv, w, m = _prepare(log_probs, old_log_probs, advantages, response_mask, is_weights)
    seq_log_ratio = log_ratio.sum(dim=-1) / m.sum(dim=-1).clamp(min=1).to(torch.float32)  # (B,)
    log_s = (lp - lp.detach() + seq_log_ratio.detach()[:, None]).clamp(max=_GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_s)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    losses = torch.maximum(loss1, loss2)
    if w is not None:
        losses = losses * w
    loss = agg_loss(losses, m, loss_agg_mode, normalizer, max_len=max_len)
    return loss, _metrics(m, loss2 > loss1, None, log_ratio)


# GMPO (geometric-mean policy optimisation, arXiv:2507.20673): the geometric mean of the token ratios, each clipped
# in log space to [-low, high] on the side the advantage's sign makes pessimistic (paper: 0.4 / 0.4), times the
# sequence's mean advantage; one loss per sequence, averaged over the sequences (verl's torch.mean also counts
# all-padding rows; N_seq or the normalizer here, as the sequence-level modes). verl leaves out the +-20 log-ratio
# clamp; we keep it, so exp stays finite.
@register_policy_loss("geo_mean", loss_agg_mode="seq-mean-token-mean", forces_loss_agg_mode=True, aliases=("gmpo",))
def _geo_mean(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode, normalizer, is_weights,
              max_len):
    _, log_ratio, adv, w, m = _prepare(log_probs, old_log_probs, advantages, response_mask, is_weights)
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-params.clip_ratio_low, params.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    n_tok = m.sum(dim=-1).to(torch.float32) + 1e-8  # verl's denominator
    seq_losses = -(adv.sum(dim=-1) / n_tok) * torch.exp(pessimistic.sum(dim=-1) / n_tok)  # (B,)
    if w is not None:  # verl: the sequence's geometric-mean weight, so a 0 ("left out") counts as 1e-10
        seq_losses = seq_losses * torch.exp(torch.where(m, torch.log(w + 1e-10), 0.0).sum(dim=-1) / n_tok)
    has_tokens = m.any(dim=-1, keepdim=True)  # (B, 1): one "token" per sequence, so the mode divides by N_seq
    loss = agg_loss(seq_losses[:, None], has_tokens, "seq-mean-token-sum", normalizer)
    clipped = log_ratio != clamped
    return loss, _metrics(m, clipped & (adv > 0), clipped & (adv < 0), log_ratio)


# CISPO (MiniMax-M1, arXiv:2506.13585): -sg[clip(rho, 1 - low, 1 + high)] A log pi, a REINFORCE term per
# token, so a token whose ratio is clipped still gets a gradient (PPO's clip zeroes it). The paper sets no lower
# bound: a clip_ratio_low near 1.
@register_policy_loss("cispo")
def _cispo(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode, normalizer, is_weights,
           max_len):
    lp, log_ratio, adv, w, m = _prepare(log_probs, old_log_probs, advantages, response_mask, is_weights)
    log_ratio, ratio = _ratio(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high).detach()
    losses = -clipped_ratio * adv * lp
    if w is not None:
        losses = losses * w
    loss = agg_loss(losses, m, loss_agg_mode, normalizer, max_len=max_len)
    return loss, _metrics(m, ratio != clipped_ratio, None, log_ratio)


# SAPO (soft adaptive policy optimisation, arXiv:2511.20347): a smooth gate f(rho) = sigmoid(tau (rho - 1)) 4 / tau
# in place of the hard clip (f(1) = 1 and f'(1) = 1, as rho; its gradient fades away from 1 instead of stopping),
# tau_pos for A > 0, tau_neg otherwise. verl always aggregates it seq-mean-token-mean; with no clip, both clip
# fractions are 0.
@register_policy_loss("sapo", loss_agg_mode="seq-mean-token-mean", forces_loss_agg_mode=True)
def _sapo(log_probs, old_log_probs, advantages, response_mask, params, loss_agg_mode, normalizer, is_weights,
          max_len):
    _, log_ratio, adv, w, m = _prepare(log_probs, old_log_probs, advantages, response_mask, is_weights)
    log_ratio, ratio = _ratio(log_ratio)
    tau = torch.where(adv > 0, float(params.tau_pos), float(params.tau_neg))
    losses = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    if w is not None:
        losses = losses * w
    loss = agg_loss(losses, m, loss_agg_mode, normalizer, max_len=max_len)
    return loss, _metrics(m, None, None, log_ratio)
