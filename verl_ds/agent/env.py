"""Environments for multi-turn rollouts: the interface, the registry and the tool-calling environment. An
environment sees and returns text only; the rollout owns the tokens (docs/agents.md, "Environments")."""
from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

from verl_ds.agent.tools import TOOL_CALL_FORMATS, ToolResult, ToolSet, parse_tool_calls, without_reasoning

__all__ = ["Environment", "Step", "StepBudget", "step_budget", "ToolEnvironment", "register_environment",
           "ENVIRONMENTS"]

ENVIRONMENTS: dict[str, type] = {}
_BUDGET: ContextVar = ContextVar("verl_ds_step_budget", default=None)


@dataclass
class Step:
    """One environment step: ``messages`` to append (role ``tool`` or ``user``), a finite ``reward`` (summed over the
    trajectory), ``done`` (a bool), ``info`` (a dict; ``tool_calls``, ``tool_errors`` counts). Else: env_error."""
    messages: list
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class StepBudget:
    """What the rollout allows the running step: ``tool_calls`` left, and ``cancelled``, set once it timed out or the
    run stops (Python cannot stop its thread, so a step running several calls checks it before each)."""
    tool_calls: int
    cancelled: threading.Event = field(default_factory=threading.Event)


def step_budget() -> StepBudget:
    """The running reset's or step's budget (``run_episodes`` sets it); outside an episode, no limit."""
    return _BUDGET.get() or StepBudget(tool_calls=1 << 62)


def run_in_budget(budget: StepBudget, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with ``step_budget()`` returning ``budget`` in it (in this thread only)."""
    token = _BUDGET.set(budget)
    try:
        return fn(*args)
    finally:
        _BUDGET.reset(token)


class Environment:
    """One instance per trajectory. ``tools`` (a ToolSet or None) is rendered into the chat template."""
    tools: ToolSet | None = None

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no arguments, got {sorted(kwargs)}")

    def reset(self, sample: dict) -> list:
        """The episode's first messages, from a data set row (its fields as the data set gives them)."""
        raise NotImplementedError

    def step(self, turn: str) -> Step:
        """React to the model's turn (its text, as decoded from the sampled tokens)."""
        raise NotImplementedError


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator: make an Environment subclass available under ``name``."""
    def add(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_environment({name!r}): {cls!r} is not a subclass of verl_ds.agent.Environment")
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(f"environment name {name!r} is already registered ({ENVIRONMENTS[name].__module__}."
                             f"{ENVIRONMENTS[name].__qualname__})")
        ENVIRONMENTS[name] = cls
        return cls
    return add


class ToolEnvironment(Environment):
    """Tool calls until an answer: one ``tool`` message per call (errors included); a turn without calls is the final
    answer, scored by ``score``. Reasoning (``<think>``) is not parsed; calls past ``step_budget`` are not run."""
    tool_format = "hermes"

    def __init__(self, tools: ToolSet, tool_format: str | None = None):
        self.tools = tools
        self.tool_format = tool_format or self.tool_format
        if self.tool_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_format {self.tool_format!r} is unknown; expected one of {TOOL_CALL_FORMATS}")

    def score(self, answer: str) -> float:
        """The reward of the final answer (the last turn's text after its reasoning)."""
        raise NotImplementedError

    def step(self, turn: str) -> Step:
        answer = without_reasoning(turn)
        parsed = parse_tool_calls(answer, self.tool_format)
        if not parsed.calls and not parsed.errors:
            return Step([], reward=self.score(answer), done=True, info={"tool_calls": 0, "tool_errors": 0})
        budget, results = step_budget(), []
        for call in parsed.calls:
            if budget.cancelled.is_set():
                break
            if len(results) >= budget.tool_calls:
                why = "not run: the episode's tool call budget (max_tool_calls) is spent"
                results.append(ToolResult(call.name, f"Error: {why}", why, call.id))
            else:
                results.append(self.tools.run(call))
        messages = [{"role": "tool", "name": r.name, "tool_call_id": r.call_id, "content": r.content} for r in results]
        messages += [{"role": "tool", "name": "error", "content": f"Error: {e}"} for e in parsed.errors]
        errors = len(parsed.errors) + sum(r.error is not None for r in results)
        return Step(messages, info={"tool_calls": len(parsed.calls) + len(parsed.errors), "tool_errors": errors})
