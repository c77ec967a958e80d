"""Multi-turn episodes: all active trajectories advance together (one generate call per turn), then one environment
step each in a worker pool. A limit ends a trajectory with a reason (END_REASONS), never an exception
(docs/agents.md, "Episodes")."""
from __future__ import annotations

import math
import numbers
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Sequence

from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.env import Environment, Step, StepBudget, run_in_budget
from verl_ds.threads import DaemonPool

__all__ = ["EpisodeLimits", "Trajectory", "run_episodes", "END_REASONS", "engine_turns"]

# "done": the environment ended it; the others are truncations
END_REASONS = ("done", "max_turns", "max_tool_calls", "context", "turn_length", "env_error", "env_timeout")

# one model turn per row: (prompt ids per active trajectory, max new tokens) -> (ids, log-probs or None) per row
GenerateFn = Callable[[list, int], list]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tool_calls: int = 8
    max_context_tokens: int = 1024
    max_turn_tokens: int = 64
    step_timeout_s: float = 10.0

    def __post_init__(self):
        for name in ("max_turns", "max_tool_calls", "max_context_tokens", "max_turn_tokens", "step_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"EpisodeLimits.{name} must be a positive number, got {value!r}")


@dataclass
class Trajectory:
    prompt_ids: list
    ids: list = field(default_factory=list)  # after the prompt: model turns and environment deltas
    model_mask: list = field(default_factory=list)  # 1 on the sampled tokens
    log_probs: list = field(default_factory=list)  # sampling log-prob per token of ids (0.0 on environment tokens)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    end: str = ""
    reason: str = ""  # what ended a truncated episode, in words

    @property
    def active(self) -> bool:
        return not self.end

    def finish(self, end: str, reason: str = "") -> None:
        self.end, self.reason = end, reason

    def append(self, ids: Sequence[int], sampled: bool, log_probs: Sequence[float] | None = None) -> None:
        self.ids += list(ids)
        self.model_mask += [int(sampled)] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)


def engine_turns(engine, pad_token_id: int, stop_token_ids: Sequence[int] = (), **sampling) -> GenerateFn:
    """A GenerateFn over ``HFRolloutEngine`` / ``VLLMRollout``: each row's sampled ids up to and including its stop
    token (EOS or ``stop_token_ids``), with their log-probs."""
    import torch

    eos = getattr(engine, "eos_token_id", None)
    extra = [int(i) for i in stop_token_ids if i != eos]
    if extra:  # an engine that knows only its EOS is never handed an empty list it may not take
        sampling = {**sampling, "stop_token_ids": extra}

    def generate(prompts: list, max_new_tokens: int) -> list:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        gen = engine.generate(ids.to(engine.device), mask.to(engine.device), max_new_tokens=max_new_tokens, **sampling)
        lengths = gen.response_length.tolist()
        return [(gen.responses[row, :n].tolist(), gen.log_probs[row, :n].tolist()) for row, n in enumerate(lengths)]
    return generate


class _Escaped(Exception):
    """A SystemExit or KeyboardInterrupt an environment raised in a worker: it ends that trajectory. A real Ctrl-C is
    raised in the main thread (Python runs signal handlers there) and stops the run."""

    def __init__(self, original: BaseException):
        super().__init__(type(original).__name__ + (f": {original}" if str(original) else ""))


def _raised(e: BaseException) -> str:
    return str(e) if isinstance(e, _Escaped) else f"{type(e).__name__}: {e}"


def _timed(budget: StepBudget, fn, *args):
    start = time.monotonic()
    try:
        return run_in_budget(budget, fn, *args), time.monotonic() - start
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 (raised by the environment: see _Escaped)
        raise _Escaped(e) from e


def _call_all(pool: DaemonPool, calls: list, timeout_s: float) -> list:
    """Run ``calls`` ((fn, arg, budget), ...) in ``pool``: (result, seconds) or the exception, each. Every budget is
    cancelled on the way out, so a step still running starts no more tool calls."""
    futures = [pool.submit(_timed, budget, fn, arg) for fn, arg, budget in calls]
    deadline = time.monotonic() + timeout_s
    out = []
    try:
        for fut in futures:
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout as e:
                out.append(e)
            except Exception as e:  # the environment's own failure: the trajectory ends, the run goes on
                out.append(e)
        return out
    finally:
        for _, _, budget in calls:
            budget.cancelled.set()


def run_episodes(generate: GenerateFn, chat: ChatTokens, envs: Sequence[Environment], samples: Sequence[dict],
                 limits: EpisodeLimits = EpisodeLimits(), workers: int = 8) -> list[Trajectory]:
    """Run one episode per (environment, sample) pair to its end; returns the trajectories in order."""
    if len(envs) != len(samples):
        raise ValueError(f"run_episodes: {len(envs)} environments for {len(samples)} samples")
    pool = DaemonPool(max(1, min(workers, len(envs))), "verl_ds-env")
    try:
        trajs = []
        resets = [(e.reset, s, StepBudget(limits.max_tool_calls)) for e, s in zip(envs, samples)]
        for got in _call_all(pool, resets, limits.step_timeout_s):
            traj = Trajectory(prompt_ids=[])
            if isinstance(got, FutureTimeout):
                traj.finish("env_timeout", f"reset took more than {limits.step_timeout_s} s")
            elif isinstance(got, BaseException):
                traj.finish("env_error", f"reset raised {_raised(got)}")
            else:
                traj.env_seconds = got[1]
                try:
                    traj.prompt_ids = chat.prompt(got[0])
                except Exception as e:  # not a message list the template can render
                    traj.finish("env_error", f"reset returned {got[0]!r:.200}, which the chat template cannot render: "
                                             f"{type(e).__name__}: {e}")
                if traj.active and len(traj.prompt_ids) >= limits.max_context_tokens:
                    traj.finish("context", f"the first prompt has {len(traj.prompt_ids)} tokens")
            trajs.append(traj)
        while True:
            for t in trajs:  # a turn starts only where a whole turn fits: one generate call serves all rows alike
                if t.active and len(t.prompt_ids) + len(t.ids) + limits.max_turn_tokens > limits.max_context_tokens:
                    t.finish("context", f"no room for turn {t.turns + 1} within {limits.max_context_tokens} tokens")
            active = [(t, env) for t, env in zip(trajs, envs) if t.active]
            if not active:
                return trajs
            turns = generate([t.prompt_ids + t.ids for t, _ in active], limits.max_turn_tokens)
            stepping = []
            for (t, env), (ids, log_probs) in zip(active, turns):
                t.append(ids, sampled=True, log_probs=log_probs)
                t.turns += 1
                if chat.ended(ids):
                    budget = StepBudget(max(0, limits.max_tool_calls - t.tool_calls))
                    stepping.append((t, env.step, chat.tokenizer.decode(ids[:-1]), budget))
                else:
                    t.finish("turn_length", f"turn {t.turns} reached {len(ids)} tokens without a stop token")
            results = _call_all(pool, [call for _, *call in stepping], limits.step_timeout_s)
            for (t, *_), got in zip(stepping, results):
                _advance(t, got, chat, limits)
    finally:
        pool.shutdown()


def _advance(t: Trajectory, got, chat: ChatTokens, limits: EpisodeLimits) -> None:
    if isinstance(got, FutureTimeout):
        return t.finish("env_timeout", f"step of turn {t.turns} took more than {limits.step_timeout_s} s")
    if isinstance(got, BaseException):
        return t.finish("env_error", f"step of turn {t.turns} raised {_raised(got)}")
    step, seconds = got
    t.env_seconds += seconds
    problem = _malformed(step)
    if problem:
        return t.finish("env_error", f"step of turn {t.turns} returned {problem}")
    t.reward += float(step.reward)
    t.tool_calls += int(step.info.get("tool_calls", 0))
    t.tool_errors += int(step.info.get("tool_errors", 0))
    if step.done:
        return t.finish("done")
    if t.turns >= limits.max_turns:
        return t.finish("max_turns", f"{t.turns} turns")
    if t.tool_calls > limits.max_tool_calls:
        return t.finish("max_tool_calls", f"{t.tool_calls} tool calls")
    try:
        delta = chat.after_turn(step.messages)
    except Exception as e:  # messages the template cannot render (a wrong role, a missing field)
        return t.finish("env_error", f"messages of turn {t.turns} cannot be rendered: {type(e).__name__}: {e}")
    if len(t.prompt_ids) + len(t.ids) + len(delta) >= limits.max_context_tokens:
        return t.finish("context", f"turn {t.turns}'s answer would pass {limits.max_context_tokens} tokens")
    t.append(delta, sampled=False)


def _malformed(step) -> str:
    """What makes ``step`` unusable ("" if well formed): one bad field would otherwise lose the whole batch."""
    if not isinstance(step, Step):
        return f"{step!r:.200}, expected a Step with a list of messages and a finite reward"
    if not isinstance(step.messages, list):
        return f"messages {step.messages!r:.200}, expected a list"
    if isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real) or not _finite(step.reward):
        return f"reward {step.reward!r:.200}, expected a finite number"
    if not isinstance(step.done, bool):
        return f"done={step.done!r:.200}, expected True or False"
    if not isinstance(step.info, dict):
        return f"info {step.info!r:.200}, expected a dict"
    for key in ("tool_calls", "tool_errors"):
        count = step.info.get(key, 0)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            return f"info[{key!r}]={count!r:.200}, expected a count (an int >= 0)"
    return ""


def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past a float's range
        return False
