"""On-policy distillation's per-token term: the student samples, a frozen teacher scores the samples, and the
negative reverse KL on each sampled token, -(log pi(y_t) - log pi_teacher(y_t)), is its reward or advantage (Agarwal
et al. 2024 GKD, arXiv:2306.13649, with the student's own samples; Lu and Thinking Machines, "On-Policy
Distillation", 2025). Its mean over samples is an unbiased estimate of KL(pi || pi_teacher) per token (k1).
"""
from __future__ import annotations

import torch

from ._checks import as_bool_mask, check_float_tensor, check_positive_number, check_same_shape

DISTILL_MODES = ("advantage", "reward")  # added to the advantages, or to the token rewards before the estimator


def reverse_kl_term(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor,
                    coef: float = 1.0) -> tuple[torch.Tensor, dict]:
    """(term, metrics). ``log_probs``, ``teacher_log_probs`` (B, R): the student's (the sampling policy's) and the
    teacher's log-probs of the sampled tokens; ``response_mask`` (B, R) bool: the tokens the model wrote (an agent's
    tool and environment tokens are attended but masked). term (B, R) float32: ``coef`` * (teacher - student) on
    masked-in tokens and exactly 0 elsewhere, whatever the inputs hold there. Metrics (0-d, detached):
    ``distill/reverse_kl`` the token mean of student - teacher, ``distill/teacher_logprob`` the token mean of the
    teacher's log-probs (0 when no token counts)."""
    check_float_tensor(log_probs, "log_probs")
    check_float_tensor(teacher_log_probs, "teacher_log_probs")
    check_same_shape(log_probs, "log_probs", teacher_log_probs, "teacher_log_probs")
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be (B, R), got shape {tuple(log_probs.shape)}")
    coef = check_positive_number(coef, "coef", allow_zero=True)
    mask = as_bool_mask(response_mask, "response_mask", log_probs.shape, "log_probs")
    student, teacher = log_probs.detach().float(), teacher_log_probs.detach().float()
    zero = torch.zeros((), dtype=torch.float32, device=student.device)
    log_ratio = torch.where(mask, student - teacher, zero)  # where(): a masked -inf or NaN never leaks in as 0 * inf
    count = mask.sum().clamp(min=1).float()
    metrics = {"distill/reverse_kl": log_ratio.sum() / count,
               "distill/teacher_logprob": torch.where(mask, teacher, zero).sum() / count}
    return -coef * log_ratio, metrics
