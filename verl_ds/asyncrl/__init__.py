"""Asynchronous RL without Ray (issue 34): one-step-off and streaming rollouts with bounded staleness.

``queue``: the bounded sample queue and the staleness rule; ``producer``: the generation thread and its weight gate.
docs/async.md says what each mode and staleness setting means.
"""
from verl_ds.asyncrl.queue import STALE_POLICIES, Group, ProducerError, SampleQueue

__all__ = ["STALE_POLICIES", "Group", "ProducerError", "SampleQueue"]
