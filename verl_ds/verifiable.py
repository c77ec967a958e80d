"""Verifiable (rule-based) rewards for reasoning tasks: is the final answer right (``math_verify``, with Hugging
Face's math-verify, https://github.com/huggingface/Math-Verify), is the format right (``format``, as in
DeepSeek-R1-style training). Shipped in ``verl_ds.rewards.REWARD_FNS``; thread-safe, so a reward model may score
samples from a thread pool.
"""
from __future__ import annotations

import re
import threading
from typing import Callable

# One <think> block with some non-space content first; then answer text (no more think tags) whose
# first \boxed{ opens a non-empty, closed box; anything but a think tag may follow (e.g. a closing
# sentence). Matched with re.DOTALL against the whole response (re.fullmatch). Each part can match in
# one way only (the text before the box cannot contain "\boxed{", the box stops at its first "}"),
# so even a degenerate response costs linear time, never quadratic backtracking.
DEFAULT_FORMAT_PATTERN = (
    r"\s*<think>\s*(?!</?think>)\S(?:(?!</?think>).)*</think>"  # the reasoning block
    r"(?:(?!</?think>|\\boxed\{).)*\\boxed\{(?!\})(?:(?!</?think>)[^}])*\}"  # answer text, its first box
    r"(?:(?!</?think>).)*"  # the rest, without think tags
)

# math-verify parses with ANTLR and sympy, whose caches are not documented as thread-safe: one call at a
# time. Its own timeout uses SIGALRM, which Python allows on the main thread only, so off the main thread
# the calls run without it (the answers parsed are the short tails the extractor picks).
_MATH_LOCK = threading.Lock()
_MATH_TIMEOUT_S = 5


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError("the math_verify reward needs the math-verify package: pip install 'verl_ds[math]' "
                          f"(or pip install math-verify); importing it failed: {e}") from e
    return parse, verify


def check_lists(who: str, prompts, responses) -> None:
    """A reward function's arguments: one response (a str) per prompt."""
    if len(prompts) != len(responses):
        raise ValueError(f"{who}: got {len(prompts)} prompts but {len(responses)} responses")
    for i, r in enumerate(responses):
        if not isinstance(r, str):
            raise TypeError(f"{who}: response {i} must be a str, got {type(r).__name__}")


def extras_field(who: str, responses, batch, field: str, noun: str) -> list:
    """``batch.extras[field]`` (a data set field passed through), one per response; ValueError naming what is
    missing or how many there are (``noun``: what the values are called in that message)."""
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


def math_answer_reward(prompts: list, responses: list, batch) -> list[float]:
    """1.0 where the response's final answer is mathematically equal to ``batch.extras["answer"]``, else 0.0.

    The answer is extracted by math-verify from the text after the last ``</think>`` (a final
    ``\\boxed{}`` first, then the last LaTeX or plain expression); a response without one scores 0. The
    reference may be LaTeX or plain (``\\frac{1}{2}``, ``1/2``, ``0.5``, ``1,234``, GSM8K ``... #### 72``);
    one that cannot be parsed raises ValueError naming the sample."""
    who = "math_verify"
    check_lists(who, prompts, responses)
    answers = extras_field(who, responses, batch, "answer", "answers")
    parse, verify = _math_verify()
    timeout = _MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for i, (response, answer) in enumerate(zip(responses, answers)):
        gold_text = _gold_text(answer)
        if not gold_text:
            raise ValueError(f"{who}: sample {i}: the answer field is empty ({answer!r:.80})")
        with _MATH_LOCK:
            # wrapped in \boxed{} the extractor takes the whole reference as one expression
            gold = parse(f"\\boxed{{{gold_text}}}", parsing_timeout=timeout) or parse(gold_text,
                                                                                   parsing_timeout=timeout)
            if not gold:
                raise ValueError(f"{who}: sample {i}: the answer field {answer!r:.80} could not be parsed as math")
            pred = parse(_final_part(response), parsing_timeout=timeout)
            correct = bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout))
        rewards.append(1.0 if correct else 0.0)
    return rewards


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
    """1.0 where the response is one non-empty ``<think>...</think>`` block followed by an answer whose
    first ``\\boxed{...}`` is non-empty and closed (:data:`DEFAULT_FORMAT_PATTERN`), else 0.0. Other
    formats: :func:`make_format_reward`."""
    return _default_format(prompts, responses, batch)
