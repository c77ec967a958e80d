"""Run-time safety: preemption (checkpoint and exit 75), explained rank failures, the non-finite guard; and
``runtime.job.Job``, the one loop that applies them to every job."""
from verl_ds.runtime.nonfinite import NonFiniteError, NonFiniteGuard
from verl_ds.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from verl_ds.runtime.rank_failure import (RankFailure, StepFailed, explains_rank_failures, is_peer_failure,
                                          raise_if_any_rank_failed)

__all__ = ["NonFiniteError", "NonFiniteGuard", "PREEMPTED_EXIT_CODE", "Preempted", "PreemptionHandler",
           "RankFailure", "StepFailed", "explains_rank_failures", "is_peer_failure", "raise_if_any_rank_failed"]
