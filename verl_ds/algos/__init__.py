"""The RL numerics as pure functions of tensors and explicit scalars, float32 results and no host sync; CUDA tensors
go to the Triton kernels of ``verl_ds.kernels`` (``VERL_DS_KERNELS``), others to chunked torch paths (``*_torch``,
the kernels' test references). Swappable parts (estimators, KL kinds, aggregations, controllers) are registries.
"""
from .advantages import (
    ADV_ESTIMATOR_NAMES,
    AdvantageEstimator,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_advantage_estimator,
    register_advantage_estimator,
    resolve_kl_placement,
    resolve_loss_agg_mode,
)
from .gae import compute_gae, compute_gae_torch
from .full_kl import full_symmetric_kl, full_symmetric_kl_torch
from .kl import KL_KINDS, kl_penalty, register_kl_estimator
from .kl_ctrl import (
    KL_CTRL_KINDS,
    BandKLController,
    FixedKLController,
    ZieglerKLController,
    make_kl_controller,
    observed_kl,
    register_kl_controller,
)
from .logprob import entropy_from_logits, logprobs_and_entropy, logprobs_and_entropy_torch, logprobs_from_logits
from .losses import value_loss
from .masked import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten, register_loss_agg
from .policy_losses import (
    POLICY_LOSS_NAMES,
    PolicyLoss,
    PolicyLossParams,
    get_policy_loss,
    policy_loss,
    register_policy_loss,
    resolve_policy_loss_agg_mode,
)
from .sampling import groups_with_signal, mean_at_k, overlong_reward_penalty, pass_at_k

__all__ = [
    "logprobs_from_logits", "entropy_from_logits", "logprobs_and_entropy", "logprobs_and_entropy_torch",
    "kl_penalty", "KL_KINDS", "register_kl_estimator", "full_symmetric_kl", "full_symmetric_kl_torch",
    "compute_gae", "compute_gae_torch",
    "compute_grpo_advantage", "compute_rloo_advantage", "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage", "compute_remax_advantage",
    "AdvantageEstimator", "register_advantage_estimator", "get_advantage_estimator", "ADV_ESTIMATOR_NAMES",
    "resolve_kl_placement", "resolve_loss_agg_mode",
    "masked_mean", "masked_var", "masked_whiten", "agg_loss", "LOSS_AGG_MODES", "register_loss_agg",
    "policy_loss", "value_loss", "PolicyLoss", "PolicyLossParams", "POLICY_LOSS_NAMES", "register_policy_loss",
    "get_policy_loss", "resolve_policy_loss_agg_mode",
    "FixedKLController", "BandKLController", "ZieglerKLController", "make_kl_controller", "register_kl_controller", "KL_CTRL_KINDS", "observed_kl",
    "overlong_reward_penalty", "groups_with_signal", "pass_at_k", "mean_at_k",
]
