"""The PPO numerics: log-probs and entropy, KL estimators, GAE, masked statistics, losses, KL controllers.

Pure functions of tensors and explicit scalars; every tensor result is float32 whatever the input
dtype. The log-prob, full-vocabulary KL and GAE functions route to the fused Triton kernels of
``verl_ds.kernels`` for CUDA tensors (``VERL_DS_KERNELS`` overrides) and to chunked torch paths
otherwise (``*_torch``, the kernels' test references).
"""
from .gae import compute_gae, compute_gae_torch
from .kl import KL_KINDS, full_symmetric_kl, full_symmetric_kl_torch, kl_penalty
from .kl_ctrl import (
    KL_CTRL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    MultiplicativeKLController,
    make_kl_controller,
)
from .logprob import entropy_from_logits, logprobs_and_entropy, logprobs_and_entropy_torch, logprobs_from_logits
from .losses import policy_loss, value_loss
from .masked import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten

__all__ = [
    "logprobs_from_logits", "entropy_from_logits", "logprobs_and_entropy", "logprobs_and_entropy_torch",
    "kl_penalty", "KL_KINDS", "full_symmetric_kl", "full_symmetric_kl_torch",
    "compute_gae", "compute_gae_torch",
    "masked_mean", "masked_var", "masked_whiten", "agg_loss", "LOSS_AGG_MODES",
    "policy_loss", "value_loss",
    "MultiplicativeKLController", "AdaptiveKLController", "FixedKLController", "make_kl_controller",
    "KL_CTRL_KINDS",
]
