"""Advantage estimators behind one registry, in verl's semantics (``verl/trainer/ppo/core_algos.py``): token_rewards
and response_mask (B, R) in, (advantages, returns) (B, R) float32 out, zero outside the response. A response's score
is the sum of its token rewards; group statistics are float64, over samples that must share the call. DAPO (Yu et
al. 2025, arXiv:2503.14476) is GRPO plus clip-higher, token-mean aggregation and ``verl_ds.algos.sampling``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ._checks import as_bool_mask, check_float_tensor, check_positive_number, check_unit_interval
from .gae import compute_gae, compute_gae_torch
from .groups import group_count_mean_std, group_inverse, group_sums
from .masked import LOSS_AGGREGATIONS, masked_whiten
from .registry import Registry

_F64 = torch.float64


def _prepare(token_rewards, response_mask):
    """(rewards float64 with zeros outside the response, bool mask); checks shapes."""
    check_float_tensor(token_rewards, "token_rewards")
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must have shape (B, R), got shape {tuple(token_rewards.shape)}")
    m = as_bool_mask(response_mask, "response_mask", token_rewards.shape, "token_rewards")
    r = torch.where(m, token_rewards.to(_F64), torch.zeros((), dtype=_F64, device=token_rewards.device))
    return r, m


def _spread(per_sample: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(B,) float64 -> (B, R) float32, the value on every response token and 0 elsewhere."""
    return torch.where(m, per_sample[:, None], torch.zeros((), dtype=_F64, device=m.device)).to(torch.float32)


def _group_scores(token_rewards, response_mask, group_index):
    r, m = _prepare(token_rewards, response_mask)
    inverse, n_groups = group_inverse(group_index, r.shape[0], r.device)
    return r.sum(dim=-1), m, inverse, n_groups


def compute_grpo_advantage(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index,
                           eps: float = 1e-6, norm_by_std: bool = True):
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (s_i - mean_g) / (std_g + eps), unbiased std, a group of
    one has mean 0 and std 1; norm_by_std=False is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), A_i = s_i - mean_g.
    returns = advantages."""
    eps = check_positive_number(eps, "eps")
    scores, m, inverse, n_groups = _group_scores(token_rewards, response_mask, group_index)
    _, mean, std = group_count_mean_std(scores, inverse, n_groups)
    centered = scores - mean
    adv = _spread(centered / (std + eps) if norm_by_std else centered, m)
    return adv, adv.clone()


def compute_rloo_advantage(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index):
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): the score minus the mean score of the other samples of its
    group (0 for a group of one, as verl's loop); returns = advantages."""
    scores, m, inverse, n_groups = _group_scores(token_rewards, response_mask, group_index)
    count = group_sums(torch.ones_like(scores), inverse, n_groups)[inverse]
    others = group_sums(scores, inverse, n_groups)[inverse] - scores
    baseline = torch.where(count > 1, others / (count - 1).clamp(min=1), 0.0)
    adv = _spread(scores - baseline, m)
    return adv, adv.clone()


def _discounted_returns(r: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_(next valid token), 0 off the mask: GAE with values 0 and lam 1, which carries G through a
    masked span (a tool's observation) undiscounted, as verl-project/verl#7300, so a last-turn reward reaches all."""
    g, _ = compute_gae_torch(r, torch.zeros_like(r), m, gamma, 1.0)
    return torch.where(m, g, torch.zeros((), dtype=g.dtype, device=g.device))


def compute_reinforce_pp_advantage(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
                                   *, whiten_fn: Callable | None = None):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns carried through masked spans, whitened over the
    valid tokens by ``whiten_fn(x, response_mask)`` (default :func:`masked_whiten`, eps 1e-8 as verl)."""
    gamma = check_unit_interval(gamma, "gamma")
    r, m = _prepare(token_rewards, response_mask)
    returns = _discounted_returns(r, m, gamma)
    adv = (whiten_fn or masked_whiten)(returns, m)
    return torch.where(m, adv.to(torch.float32), torch.zeros((), device=adv.device)), returns


def compute_reinforce_pp_baseline_advantage(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index,
                                            *, whiten_fn: Callable | None = None):
    """REINFORCE++ with a group baseline (the same paper): (score - group mean) on every response token, whitened
    over the valid tokens (eps 1e-8, as verl; a group of one has mean 0)."""
    scores, m, inverse, n_groups = _group_scores(token_rewards, response_mask, group_index)
    _, mean, _ = group_count_mean_std(scores, inverse, n_groups)
    centered = _spread(scores - mean, m)
    adv = (whiten_fn or masked_whiten)(centered, m)
    adv = torch.where(m, adv.to(torch.float32), torch.zeros((), device=adv.device))
    return adv, adv.clone()


def compute_remax_advantage(token_rewards: torch.Tensor, response_mask: torch.Tensor, baseline_scores: torch.Tensor):
    """ReMax (Li et al. 2023, arXiv:2310.10505): A = G_t - baseline_scores (B,), G_t the rewards from t on."""
    r, m = _prepare(token_rewards, response_mask)
    check_float_tensor(baseline_scores, "baseline_scores")
    if tuple(baseline_scores.shape) != (r.shape[0],):
        raise ValueError(f"baseline_scores must have shape (B,) = ({r.shape[0]},), got shape "
                         f"{tuple(baseline_scores.shape)}")
    returns = r.flip(1).cumsum(dim=1).flip(1)
    zero = torch.zeros((), dtype=_F64, device=r.device)
    adv = torch.where(m, returns - baseline_scores.to(device=r.device, dtype=_F64)[:, None], zero)
    return adv.to(torch.float32), torch.where(m, returns, zero).to(torch.float32)


# --- registry ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator, ``est(token_rewards, response_mask, *, values, group_index, baseline_scores, gamma,
    lam, eps, whiten_fn)``; its flags say which inputs it needs and what ``auto`` means for the algo keys."""
    name: str
    fn: Callable
    needs_critic: bool = False
    needs_groups: bool = False
    needs_baseline: bool = False
    kl_placement: str = "reward"
    loss_agg_mode: str = "token-mean"

    def __call__(self, token_rewards, response_mask, *, values=None, group_index=None, baseline_scores=None,
                 gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6, whiten_fn: Callable | None = None):
        for needed, value, what in ((self.needs_critic, values, "values (the critic's (B, R) predictions)"),
                                    (self.needs_groups, group_index, "group_index (one group id per sample)"),
                                    (self.needs_baseline, baseline_scores,
                                     "baseline_scores (the (B,) greedy-response scores)")):
            if needed and value is None:
                raise ValueError(f"advantage estimator {self.name!r} needs {what}")
        return self.fn(token_rewards, response_mask, values=values, group_index=group_index,
                       baseline_scores=baseline_scores, gamma=gamma, lam=lam, eps=eps, whiten_fn=whiten_fn)


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "names")
ADV_ESTIMATOR_NAMES = ADVANTAGE_ESTIMATORS.view()


def register_advantage_estimator(name: str, *, needs_critic: bool = False, needs_groups: bool = False,
                                 needs_baseline: bool = False, kl_placement: str = "reward",
                                 loss_agg_mode: str = "token-mean", aliases: tuple = ()):
    """Decorator registering an ``AdvantageEstimator``'s ``fn`` under ``name``; a taken name raises."""
    if kl_placement not in ("reward", "loss"):
        raise ValueError(f"kl_placement: expected 'reward' or 'loss', got {kl_placement!r}")
    LOSS_AGGREGATIONS.get(loss_agg_mode)  # an unknown mode raises, naming the valid ones

    def add(fn):
        ADVANTAGE_ESTIMATORS.register(name, aliases=aliases)(
            AdvantageEstimator(name, fn, bool(needs_critic), bool(needs_groups), bool(needs_baseline), kl_placement,
                               loss_agg_mode))
        return fn
    return add


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; an unknown name lists the known ones and the closest."""
    return ADVANTAGE_ESTIMATORS.get(name)


def resolve_kl_placement(kl_placement: str, adv_estimator: str) -> str:
    """``algo.kl_placement``: ``auto`` -> the estimator's convention (in the loss for grpo, dr_grpo and the REINFORCE++
    pair, in the reward for gae, rloo and remax); ``reward`` and ``loss`` are returned as they are."""
    return get_advantage_estimator(adv_estimator).kl_placement if kl_placement == "auto" else kl_placement


def resolve_loss_agg_mode(loss_agg_mode: str, adv_estimator: str) -> str:
    """``algo.loss_agg_mode``: ``auto`` -> the estimator's aggregation (seq-mean-token-sum-norm for dr_grpo,
    token-mean for the others); any other mode is returned as it is."""
    return get_advantage_estimator(adv_estimator).loss_agg_mode if loss_agg_mode == "auto" else loss_agg_mode


@register_advantage_estimator("gae", needs_critic=True)
def _gae(token_rewards, response_mask, *, values, gamma, lam, **_):
    adv, ret = compute_gae(token_rewards, values, response_mask, gamma, lam)
    m = as_bool_mask(response_mask, "response_mask", token_rewards.shape, "token_rewards")
    zero = torch.zeros((), dtype=torch.float32, device=adv.device)
    return torch.where(m, adv, zero), torch.where(m, ret, zero)


# GRPO keeps its KL term in the loss (Shao et al. 2024, DeepSeekMath, eq. 3): in the reward, dividing by the group's
# std turns the tiny KL differences between equally rewarded samples into advantages of order 1.
@register_advantage_estimator("grpo", needs_groups=True, kl_placement="loss")
def _grpo(token_rewards, response_mask, *, group_index, eps, **_):
    return compute_grpo_advantage(token_rewards, response_mask, group_index, eps=eps, norm_by_std=True)


# Dr.GRPO also drops GRPO's 1/|o_i| length normalisation: each sequence's token sum over one constant, the generation
# budget (Liu et al. 2025, section 3.1 and their listing: MAX_TOKENS; verl's seq-mean-token-sum-norm).
@register_advantage_estimator("dr_grpo", needs_groups=True, kl_placement="loss",
                              loss_agg_mode="seq-mean-token-sum-norm")
def _dr_grpo(token_rewards, response_mask, *, group_index, eps, **_):
    return compute_grpo_advantage(token_rewards, response_mask, group_index, eps=eps, norm_by_std=False)


@register_advantage_estimator("rloo", needs_groups=True)
def _rloo(token_rewards, response_mask, *, group_index, **_):
    return compute_rloo_advantage(token_rewards, response_mask, group_index)


# REINFORCE++ whitens over the batch, so its KL term goes in the loss too (as verl's REINFORCE++ examples,
# volcengine/verl@3f38806 examples/reinforce_plus_plus_trainer: use_kl_loss=True, use_kl_in_reward=False): once
# nearly every sample is rewarded alike, whitening scales the KL penalty's differences up to unit advantages.
@register_advantage_estimator("reinforce_plus_plus", kl_placement="loss")
def _reinforce_pp(token_rewards, response_mask, *, gamma, whiten_fn, **_):
    return compute_reinforce_pp_advantage(token_rewards, response_mask, gamma, whiten_fn=whiten_fn)


@register_advantage_estimator("reinforce_plus_plus_baseline", needs_groups=True, kl_placement="loss")
def _reinforce_pp_baseline(token_rewards, response_mask, *, group_index, whiten_fn, **_):
    return compute_reinforce_pp_baseline_advantage(token_rewards, response_mask, group_index, whiten_fn=whiten_fn)


@register_advantage_estimator("remax", needs_baseline=True)
def _remax(token_rewards, response_mask, *, baseline_scores, **_):
    return compute_remax_advantage(token_rewards, response_mask, baseline_scores)
