"""Preference losses: the Bradley-Terry reward-model loss and DPO with its IPO and reference-free variants. Pure
functions: per-pair tensors (B,) in, per-pair losses (B,) and metrics under TRL's names out, so the caller reduces
over micro-batches and ranks; float64 stays float64, narrower dtypes compute in float32. Formulas: docs/stages.md."""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from verl_ds.algos._checks import as_bool_mask, check_float_tensor, check_same_shape

__all__ = ["DPO_LOSS_TYPES", "sequence_logps", "reward_model_loss", "dpo_loss", "mean_metrics"]

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _pairs(name: str, x, like: torch.Tensor | None = None, like_name: str = "") -> torch.Tensor:
    check_float_tensor(x, name)
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one value per pair), got shape {tuple(x.shape)}")
    if like is not None:
        check_same_shape(like, like_name, x, name)
    return x


def _finite(name: str, value, *, lo: float | None = None, hi: float | None = None, open_lo: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if lo is not None and (value < lo or (open_lo and value == lo)):
        raise ValueError(f"{name} must be {'>' if open_lo else '>='} {lo:g}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi:g}, got {value!r}")
    return value


def sequence_logps(token_logps: torch.Tensor, mask, *, average: bool = False) -> torch.Tensor:
    """(B,) each row's completion log-prob: ``token_logps`` (B, T) summed over ``mask`` (B, T), or averaged (IPO, as
    TRL). A row with no completion token is refused (its sum would be 0 and its mean undefined)."""
    check_float_tensor(token_logps, "token_logps")
    if token_logps.dim() != 2:
        raise ValueError(f"token_logps must be 2-D (B, T), got shape {tuple(token_logps.shape)}")
    m = as_bool_mask(mask, "mask", token_logps.shape, "token_logps")
    counts = m.sum(-1)
    if bool((counts == 0).any()):
        raise ValueError(f"mask rows {(counts == 0).nonzero().flatten().tolist()} have no completion token; every "
                         "pair needs a non-empty chosen and rejected completion")
    x = token_logps.to(_compute_dtype(token_logps))
    total = torch.where(m, x, torch.zeros_like(x)).sum(-1)  # where, not *: a NaN in padding stays out
    return total / counts if average else total


def reward_model_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                      margin: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry losses (B,) ``-log sigmoid(r_chosen - r_rejected - margin)`` (Bradley & Terry 1952; Ouyang et al.
    2022, eq. 1; ``margin`` optional, per pair, as TRL's RewardTrainer) and the means of ``accuracy`` and ``margin``."""
    _pairs("chosen_rewards", chosen_rewards)
    _pairs("rejected_rewards", rejected_rewards, chosen_rewards, "chosen_rewards")
    dtype = _compute_dtype(chosen_rewards)
    diff = chosen_rewards.to(dtype) - rejected_rewards.to(dtype)
    logits = diff
    if margin is not None:
        _pairs("margin", margin, chosen_rewards, "chosen_rewards")
        logits = diff - margin.to(dtype)
    losses = -F.logsigmoid(logits)
    d = diff.detach()
    return losses, {"accuracy": (d > 0).to(dtype).mean(), "margin": d.mean()}


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None, *, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             reference_free: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO losses (B,) on sequence log-probs (B,) and the means of TRL's DPOTrainer metrics. With x the policy's minus
    the reference's chosen-rejected log-prob difference: "sigmoid" ``-(1-eps) log sig(beta x) - eps log sig(-beta x)``
    (Rafailov et al. 2023, eq. 7; eps of conservative DPO, Mitchell 2023, eq. 3), "ipo" ``(x - 1/(2 beta))^2`` (Azar et
    al. 2023, eq. 17). ``reference_free``: the reference log-probs are 0."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {list(DPO_LOSS_TYPES)}, got {loss_type!r}")
    beta = _finite("beta", beta, lo=0.0, open_lo=True)
    eps = _finite("label_smoothing", label_smoothing, lo=0.0)
    if eps >= 0.5:  # at 0.5 the loss ignores the labels; above it prefers the rejected completion
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if loss_type == "ipo" and eps:
        raise ValueError("label_smoothing applies to the sigmoid loss only; set it to 0 with loss_type 'ipo'")
    _pairs("policy_chosen_logps", policy_chosen_logps)
    _pairs("policy_rejected_logps", policy_rejected_logps, policy_chosen_logps, "policy_chosen_logps")
    dtype = _compute_dtype(policy_chosen_logps)
    pc, pr = policy_chosen_logps.to(dtype), policy_rejected_logps.to(dtype)
    if reference_free:
        rc = rr = torch.zeros_like(pc)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError("ref_chosen_logps and ref_rejected_logps are required unless reference_free=True")
        _pairs("ref_chosen_logps", ref_chosen_logps, policy_chosen_logps, "policy_chosen_logps")
        _pairs("ref_rejected_logps", ref_rejected_logps, policy_chosen_logps, "policy_chosen_logps")
        # the reference is a constant of the loss: no gradient may flow into it
        rc, rr = ref_chosen_logps.detach().to(dtype), ref_rejected_logps.detach().to(dtype)
    x = (pc - pr) - (rc - rr)
    if loss_type == "ipo":
        losses = (x - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * x) * (1.0 - eps) - F.logsigmoid(-beta * x) * eps
    chosen = beta * (pc - rc).detach()
    rejected = beta * (pr - rr).detach()
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/accuracies": (chosen > rejected).to(dtype).mean(),
               "rewards/margins": (chosen - rejected).mean(),
               "logps/chosen": pc.detach().mean(), "logps/rejected": pr.detach().mean()}
    return losses, metrics


def mean_metrics(parts: list[tuple[dict[str, torch.Tensor], int]]) -> dict[str, float]:
    """The pair-weighted mean of per-micro-batch ``[(metrics, n_pairs), ...]``: those pairs' metrics as one batch."""
    total = sum(n for _, n in parts)
    if not parts or total <= 0:
        raise ValueError("mean_metrics: expected at least one (metrics, n_pairs) with n_pairs > 0")
    keys = list(parts[0][0])
    return {k: sum(float(m[k]) * n for m, n in parts) / total for k in keys}
