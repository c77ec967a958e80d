"""Verifiable rewards: is the final answer right (``math_verify``, Hugging Face's math-verify,
https://github.com/huggingface/Math-Verify), is the format right (``format``, as in DeepSeek-R1-style training).
Thread-safe; model text is hostile input, so each check is bounded (math-verify in worker processes killed past a
timeout, the format regex in linear time). Details: docs/config.md, "Rule-based rewards on model text"."""
from __future__ import annotations

import importlib.util
import math
import re
from typing import Callable

from verl_ds.verify_pool import WorkerPool

# re.fullmatch with re.DOTALL. Each part can match in one way only (no "\boxed{" before the box, the box stops at
# its first "}"), so even a degenerate response costs linear time, never quadratic backtracking.
DEFAULT_FORMAT_PATTERN = (
    r"\s*<think>\s*(?!</?think>)\S(?:(?!</?think>).)*</think>"  # the reasoning block
    r"(?:(?!</?think>|\\boxed\{).)*\\boxed\{(?!\})(?:(?!</?think>)[^}])*\}"  # answer text, its first box
    r"(?:(?!</?think>).)*"  # the rest, without think tags
)

DEFAULT_MATH_TIMEOUT_S = 5.0  # reward.math_verify_timeout_s's default; a benign answer takes well under a second
_math_timeout_s = DEFAULT_MATH_TIMEOUT_S
_POOL = WorkerPool()  # workers start on the first check


class Scores(list):
    """One float per response, plus side metrics ``metrics[key]`` logged as ``reward/<function>/<key>``."""

    def __init__(self, scores, metrics: dict | None = None):
        super().__init__(scores)
        self.metrics = dict(metrics or {})


def set_math_verify_timeout(seconds: float) -> None:
    """Seconds one ``math_verify`` check may take; past it the worker is killed and the answer scores 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"math_verify timeout: expected a finite number of seconds > 0, got {seconds!r}")
    global _math_timeout_s
    _math_timeout_s = float(seconds)


def _require_math_verify() -> None:
    if importlib.util.find_spec("math_verify") is None:  # the workers import it; say what to install here
        raise ImportError("the math_verify reward needs the math-verify package: pip install 'verl_ds[math]' "
                          "(or pip install math-verify)")


def check_lists(who: str, prompts, responses) -> None:
    """A reward function's arguments: one response (a str) per prompt."""
    if len(prompts) != len(responses):
        raise ValueError(f"{who}: got {len(prompts)} prompts but {len(responses)} responses")
    for i, r in enumerate(responses):
        if not isinstance(r, str):
            raise TypeError(f"{who}: response {i} must be a str, got {type(r).__name__}")


def extras_field(who: str, responses, batch, field: str, noun: str) -> list:
    """``batch.extras[field]``, one per response; ValueError naming what is missing (``noun``: the values' name)."""
    extras = getattr(batch, "extras", None) or {}
    if field not in extras:
        raise ValueError(f"{who}: needs the data set's {field!r} field passed through (batch.extras[{field!r}]); "
                         f"extras has {sorted(extras)}")
    values = extras[field]
    if len(values) != len(responses):
        raise ValueError(f"{who}: got {len(values)} {noun} for {len(responses)} responses")
    return list(values)


def _gold_text(answer) -> str:
    """The reference as text; GSM8K's '<solution> #### 72' is reduced to what follows '####'."""
    if isinstance(answer, bool) or answer is None:
        return ""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text


def _final_part(response: str) -> str:
    """The text after the last </think> (the answer part), or the whole response."""
    return response.rsplit("</think>", 1)[1] if "</think>" in response else response


def math_answer_reward(prompts: list, responses: list, batch) -> Scores:
    """1.0 where the answer after the last ``</think>`` equals ``batch.extras["answer"]`` mathematically, else 0.0;
    an unparsable reference raises ValueError, a timed-out check scores 0 (side metric ``timed_out``)."""
    who = "math_verify"
    check_lists(who, prompts, responses)
    answers = extras_field(who, responses, batch, "answer", "answers")
    _require_math_verify()
    timeout = _math_timeout_s
    rewards, timed_out = [], []
    for i, (response, answer) in enumerate(zip(responses, answers)):
        gold_text = _gold_text(answer)
        if not gold_text:
            raise ValueError(f"{who}: sample {i}: the answer field is empty ({answer!r:.80})")
        reply = _POOL.ask({"gold": gold_text, "pred": _final_part(response)}, timeout)
        if reply is None:  # the answer, or the reference? A reference that cannot be parsed in time is bad data
            reply = _POOL.ask({"gold": gold_text, "pred": None}, timeout)
            if reply is None:
                raise ValueError(f"{who}: sample {i}: parsing the answer field {answer!r:.80} took over "
                                 f"{timeout:g} s (reward.math_verify_timeout_s)")
            reply["correct"] = None
        if not reply["gold"]:
            raise ValueError(f"{who}: sample {i}: the answer field {answer!r:.80} could not be parsed as math")
        rewards.append(1.0 if reply["correct"] else 0.0)
        timed_out.append(1.0 if reply["correct"] is None else 0.0)
    return Scores(rewards, {"timed_out": timed_out})


def make_format_reward(pattern: str, flags: int = re.DOTALL) -> Callable[[list, list, object], list]:
    """A reward function: 1.0 where the whole response matches ``pattern`` (re.fullmatch, ``flags``)."""
    if not isinstance(pattern, str):
        raise TypeError(f"format pattern must be a str (a regular expression), got {type(pattern).__name__}")
    try:
        regex = re.compile(pattern, flags)
    except re.error as e:
        raise ValueError(f"format pattern {pattern!r:.80} is not a valid regular expression: {e}") from None

    def reward(prompts: list, responses: list, batch=None) -> list[float]:
        check_lists("format", prompts, responses)
        return [1.0 if regex.fullmatch(r) else 0.0 for r in responses]

    reward.__doc__ = f"1.0 where the whole response matches {pattern!r} (fullmatch), else 0.0."
    reward.pattern = regex
    return reward


_default_format = make_format_reward(DEFAULT_FORMAT_PATTERN)


def format_reward(prompts: list, responses: list, batch=None) -> list[float]:
    """1.0 for one non-empty ``<think>...</think>`` then an answer with a non-empty ``\\boxed{...}``, else 0.0."""
    return _default_format(prompts, responses, batch)
