"""Asynchronous RL without Ray: one-step-off and streaming rollouts with bounded staleness (docs/async.md).
``queue``: the bounded sample queue and the staleness rule; ``producer``: the generation thread and its weight gate."""
from verl_ds.asyncrl.queue import STALE_POLICIES, Group, ProducerError, SampleQueue

__all__ = ["STALE_POLICIES", "Group", "ProducerError", "SampleQueue"]
