"""Run-time safety: preemption (checkpoint and exit 75), explained rank failures, the non-finite guard."""
from verl_ds.runtime.nonfinite import NonFiniteError, NonFiniteGuard
from verl_ds.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from verl_ds.runtime.rank_failure import RankFailure, explains_rank_failures, is_peer_failure

__all__ = ["NonFiniteError", "NonFiniteGuard", "PREEMPTED_EXIT_CODE", "Preempted", "PreemptionHandler",
           "RankFailure", "explains_rank_failures", "is_peer_failure"]
