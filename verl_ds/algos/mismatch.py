"""Rollout-mismatch correction: per-token weights of the policy loss from the trainer's (``old_log_probs``) and the
sampler's (``rollout_log_probs``) log-probs, as verl 0.9.1's rollout correction with TRL's mode names (docs/vllm.md,
"Rollout-mismatch correction"). Left-out tokens get weight 0 and keep their place in the loss's normaliser (as TRL),
so the trainer's global normaliser and each micro-batch's share of the loss are what they are without a correction.
"""
from __future__ import annotations

import math

import torch

from ._checks import as_bool_mask, check_float_tensor, check_positive_number, check_same_shape
from .masked import masked_mean

# exp(20) ~ 5e8: a weight stays finite for any drift (verl's SAFETY_BOUND)
LOG_RATIO_BOUND = 20.0
# a token whose log-prob is -inf on one side only: clamped before summing so a row cannot become inf - inf
_SUM_BOUND = 1e4

# rollout.is_mode -> (level of rho, what happens outside the band): truncate min(rho, cap) (TIS: Yao et al. 2025,
# https://fengyao.notion.site/off-policy-rl); mask rho inside [low, cap], else 0 (low > 0: IcePop, arXiv:2510.18855;
# low = 0: TRL's masks); filter 1 inside, else 0 (the geometric mean is no importance weight, only a test)
IS_MODES = {
    "truncate": ("token", "truncate"),  # the first name of token_truncate
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
    "geo_mask": ("geo", "filter"),
    # AReaL's decoupled PPO (Fu et al. 2025, arXiv:2505.24298, eq. 5) weights pi_prox / pi_behav and leaves out
    # tokens over the cap (behav_imp_weight_cap): token_mask, with old_log_probs the proximal policy
    "decoupled": ("token", "mask"),
}
MASK_MODES = tuple(n for n, (_, action) in IS_MODES.items() if action != "truncate")

# verl's rejection criteria: k1 = log(pi_sampler / pi_train) is signed and takes a band, k2 and k3 an upper bound;
# a per-sequence maximum of the signed k1 bounds one side only, so there is no seq_max_k1 (token_k1 is its band)
REJECTION_CRITERIA = tuple(f"{scope}_{k}" for scope in ("token", "seq_sum", "seq_mean", "seq_max")
                           for k in ("k1", "k2", "k3") if (scope, k) != ("seq_max", "k1"))
REJECTION_FORMAT = ("'criterion:threshold[,criterion:threshold...]', e.g. 'token_k3:0.01' or 'seq_mean_k1:0.999_1.001' "
                    "(k1: 'low_high' bounds of pi_sampler / pi_train, or one number u for [1/u, u]; k2, k3: an upper "
                    f"bound); criteria: {', '.join(REJECTION_CRITERIA)}")


def parse_rejection(spec) -> tuple:
    """``spec`` (``rollout.is_rejection``: None or REJECTION_FORMAT) -> ((criterion, low, high), ...), the bounds
    of the statistic: log-bounds for k1, (None, upper) for k2 and k3. ValueError naming what is wrong."""
    if spec is None:
        return ()
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"rejection must be None or a non-empty string {REJECTION_FORMAT}; got {spec!r}")
    out, seen = [], set()
    for part in (p.strip() for p in spec.split(",")):
        name, sep, threshold = part.partition(":")
        name, threshold = name.strip(), threshold.strip()
        if not sep or not threshold:
            raise ValueError(f"rejection {part!r} has no threshold; expected {REJECTION_FORMAT}")
        if name not in REJECTION_CRITERIA:
            why = "; seq_max_k1 does not exist (k1 is signed): token_k1 bounds each token" if name == "seq_max_k1" \
                else ""
            raise ValueError(f"rejection criterion {name!r} is unknown{why}; expected {REJECTION_FORMAT}")
        if name in seen:
            raise ValueError(f"rejection criterion {name!r} is given twice in {spec!r}")
        seen.add(name)
        bounds = threshold.split("_")
        try:
            values = [float(b) for b in bounds]
        except ValueError:
            raise ValueError(f"rejection {part!r}: threshold {threshold!r} is not a number; expected "
                             f"{REJECTION_FORMAT}") from None
        if not all(math.isfinite(v) and v > 0 for v in values) or len(values) > 2:
            raise ValueError(f"rejection {part!r}: thresholds must be finite numbers > 0; expected {REJECTION_FORMAT}")
        if name.endswith("k1"):
            lo, hi = values if len(values) == 2 else (1.0 / values[0], values[0])
            if lo > hi:
                raise ValueError(f"rejection {part!r}: the band's low bound {lo} exceeds its high bound {hi}")
            out.append((name, math.log(lo), math.log(hi)))
        else:
            if len(values) != 1:
                raise ValueError(f"rejection {part!r}: {name} takes one upper bound, got {threshold!r}")
            out.append((name, None, values[0]))
    return tuple(out)


def check_mode(mode, cap, low) -> tuple[str, float, float]:
    """(mode, cap, low) checked: a name of IS_MODES, cap >= 1, 0 <= low < 1, low > 0 only for a mask mode."""
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {list(IS_MODES)}, got {mode!r}")
    cap = check_positive_number(cap, "cap")
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1 (a weight is truncated or left out above cap; below 1 on-policy tokens "
                         f"would be), got {cap!r}")
    low = check_positive_number(low, "low", allow_zero=True)
    if low >= 1.0:
        raise ValueError(f"low must be in [0, 1) (tokens whose ratio is below low are left out; at 1 or more "
                         f"on-policy tokens would be), got {low!r}")
    if low > 0 and mode not in MASK_MODES:
        raise ValueError(f"low={low} is the lower bound of a mask mode's band ({', '.join(MASK_MODES)}); mode "
                         f"{mode!r} truncates and has none: set low 0 or a mask mode")
    return mode, cap, low


def mismatch_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                     mode: str | None = "token_truncate", cap: float = 2.0, low: float = 0.0, rejection=None):
    """Weights (B, R) of the policy loss, float32 without grad, 0 on padding and on every left-out token, and
    detached 0-d metrics. ``old_log_probs`` (B, R) the trainer's, ``rollout_log_probs`` (B, R) the sampler's (any
    float dtype; computed in float32), ``response_mask`` (B, R) bool or 0/1. ``mode`` (IS_MODES; None: weight 1,
    rejection only) with ``cap`` and ``low``; ``rejection`` a ``parse_rejection`` spec (string or parsed).
    Metrics over the valid tokens: is_weight_mean, is_masked_frac (weight 0), is_seq_masked_frac (sequences with
    one), is_ratio_mean/min/max (the token ratio), mismatch_k1 / mismatch_k3 (token KL(sampler || trainer)
    estimates, verl's kl and k3_kl), mismatch_seq_k1 (its per-sequence sum); with a mode is_capped_frac (tokens
    whose ratio at the mode's level exceeds cap)."""
    check_float_tensor(old_log_probs, "old_log_probs")
    if old_log_probs.dim() != 2:
        raise ValueError(f"old_log_probs must have shape (B, R), got shape {tuple(old_log_probs.shape)}")
    check_float_tensor(rollout_log_probs, "rollout_log_probs")
    check_same_shape(old_log_probs, "old_log_probs", rollout_log_probs, "rollout_log_probs")
    m = as_bool_mask(response_mask, "response_mask", old_log_probs.shape, "old_log_probs")
    if mode is not None:
        mode, cap, low = check_mode(mode, cap, low)
    criteria = rejection if isinstance(rejection, tuple) else parse_rejection(rejection)
    zero = torch.zeros((), dtype=torch.float32, device=old_log_probs.device)
    with torch.no_grad():
        # padding first: the sampler reports 0 there, and a NaN past the end must not reach a weight
        raw = torch.where(m, old_log_probs.float() - rollout_log_probs.float(), zero)  # log rho per token
        log_ratio = raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        n_tok = m.sum(dim=-1)  # (B,)
        keep = m.clone()
        metrics = {}
        if mode is None:
            weights = m.float()
        else:
            level, action = IS_MODES[mode]
            if level == "token":
                level_log = log_ratio
            else:
                total = raw.clamp(-_SUM_BOUND, _SUM_BOUND).sum(dim=-1, keepdim=True)  # (B, 1)
                if level == "geo":
                    total = total / n_tok.clamp(min=1).unsqueeze(-1).float()
                level_log = total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(raw)
            rho = torch.exp(level_log)
            if action == "truncate":
                weights = rho.clamp(max=cap)
            else:
                inside = (rho >= low) & (rho <= cap)
                keep &= inside
                weights = rho if action == "mask" else torch.ones_like(rho)
            metrics["is_capped_frac"] = masked_mean((rho > cap).float(), m)
        for name, lo, hi in criteria:
            keep &= _passes(name, lo, hi, log_ratio, m, n_tok)
        weights = torch.where(keep, weights, zero)
        dropped = m & ~keep
        valid_rows = n_tok > 0
        k1 = -log_ratio  # log(pi_sampler / pi_train), 0 on padding
        seq_k1 = k1.sum(dim=-1)
        has_tok = m.any()
        metrics.update({
            "is_weight_mean": masked_mean(weights, m),
            "is_masked_frac": masked_mean(dropped.float(), m),
            "is_seq_masked_frac": masked_mean(dropped.any(dim=-1).float(), valid_rows),
            "is_ratio_mean": masked_mean(ratio, m),
            "is_ratio_min": torch.where(has_tok, torch.where(m, ratio, math.inf).amin(), zero),
            "is_ratio_max": torch.where(has_tok, torch.where(m, ratio, -math.inf).amax(), zero),
            "mismatch_k1": masked_mean(k1, m),
            "mismatch_k3": masked_mean(ratio - 1.0 - log_ratio, m),
            "mismatch_seq_k1": masked_mean(seq_k1, valid_rows),
        })
    return weights, metrics


def _passes(name: str, lo, hi, log_ratio: torch.Tensor, m: torch.Tensor, n_tok: torch.Tensor) -> torch.Tensor:
    """(B, R) bool: where criterion ``name`` keeps a token (sequence criteria: the whole row); verl's statistics of
    the clamped log-ratio, k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho."""
    scope, _, estimator = name.rpartition("_")
    stat = {"k1": -log_ratio, "k2": 0.5 * log_ratio.square(), "k3": torch.exp(log_ratio) - 1.0 - log_ratio}[estimator]
    stat = torch.where(m, stat, 0.0)
    if scope == "seq_sum":
        stat = stat.sum(dim=-1, keepdim=True)
    elif scope == "seq_mean":
        stat = stat.sum(dim=-1, keepdim=True) / n_tok.clamp(min=1).unsqueeze(-1).float()
    elif scope == "seq_max":  # k2, k3 >= 0: padding's 0 never exceeds a valid token's value; empty rows give 0
        stat = stat.amax(dim=-1, keepdim=True)
    ok = stat <= hi
    if lo is not None:
        ok = ok & (stat >= lo)
    return ok.expand_as(log_ratio)


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float = 2.0):
    """Truncated importance sampling (TIS, verl's ``tis_imp_ratio_cap``): w = min(exp(old_log_probs -
    rollout_log_probs), cap) per token; ``mismatch_weights`` in mode token_truncate."""
    return mismatch_weights(old_log_probs, rollout_log_probs, response_mask, "token_truncate", cap)


def decoupled_is_weights(prox_log_probs: torch.Tensor, behav_log_probs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float = 2.0):
    """Behaviour weights of the decoupled PPO objective (AReaL: Fu et al. 2025, arXiv:2505.24298, eq. 5): w = pi_prox
    / pi_behav per token, pi_behav the sampler (``rollout_log_probs``, maybe older actors), pi_prox the actor before
    this update (``old_log_probs``): the trust region is around pi_prox, not a stale behaviour policy. A token over
    ``cap`` gets weight 0, as AReaL's ``behav_imp_weight_cap``; ``mismatch_weights`` in mode decoupled."""
    return mismatch_weights(prox_log_probs, behav_log_probs, response_mask, "decoupled", cap)
