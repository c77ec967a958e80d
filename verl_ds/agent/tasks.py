"""Built-in agent tasks: ``calc`` (arithmetic a small model cannot do in its head but can by calling the calc tool
and copying the result) and ``guess_number`` (several turns of higher / lower feedback)."""
from __future__ import annotations

import random
import re

from verl_ds.agent.env import Environment, Step, ToolEnvironment, register_environment
from verl_ds.agent.tools import ToolSet, calc

__all__ = ["CalcEnvironment", "GuessNumberEnvironment", "calc_samples", "guess_samples", "last_integer"]

_INT = re.compile(r"-?\d+")
OPERATORS = ("+", "-", "*")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (the answer's convention), or None."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def calc_samples(n: int, seed: int, digits: tuple[int, int] = (3, 4)) -> list[dict]:
    """``n`` rows {"question", "expression", "answer"}; the same (n, seed) gives the same rows."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    lo, hi = digits
    if not 1 <= lo <= hi <= 9:
        raise ValueError(f"digits: expected (min, max) with 1 <= min <= max <= 9, got {digits!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = (rng.randrange(10 ** (d - 1), 10 ** d) for d in (rng.randint(lo, hi), rng.randint(lo, hi)))
        expression = f"{max(a, b)} {rng.choice(OPERATORS)} {min(a, b)}"
        rows.append({"question": f"What is {expression}?", "expression": expression, "answer": calc(expression)})
    return rows


def guess_samples(n: int, seed: int, high: int = 16) -> list[dict]:
    """``n`` rows {"secret", "high"}: a number from 1 to ``high`` to find."""
    if not isinstance(n, int) or n < 1 or not isinstance(high, int) or high < 2:
        raise ValueError(f"guess_samples: expected n >= 1 and high >= 2, got n={n!r}, high={high!r}")
    rng = random.Random(seed)
    return [{"secret": rng.randint(1, high), "high": high} for _ in range(n)]


@register_environment("calc")
class CalcEnvironment(ToolEnvironment):
    """Arithmetic with the calc tool; reward 1 when the final answer's last integer is the result."""

    def __init__(self, tool_format: str | None = None):
        super().__init__(ToolSet([calc]), tool_format)
        self.answer = None

    def reset(self, sample: dict) -> list:
        self.answer = int(sample["answer"])
        return [{"role": "system", "content": "Use the calc tool for arithmetic, then answer with the number only."},
                {"role": "user", "content": sample["question"]}]

    def score(self, answer: str) -> float:
        return float(last_integer(answer) == self.answer)


@register_environment("guess_number")
class GuessNumberEnvironment(Environment):
    """Find a number from 1 to ``high`` by higher / lower feedback; reward 1 for the right guess."""

    def __init__(self):
        super().__init__()
        self.secret = self.high = None

    def reset(self, sample: dict) -> list:
        self.secret, self.high = int(sample["secret"]), int(sample["high"])
        return [{"role": "user", "content": f"I think of a number from 1 to {self.high}. Guess it: answer with a "
                                            f"number, and I will say higher or lower."}]

    def step(self, turn: str) -> Step:
        guess = last_integer(turn)
        if guess is None:
            return Step([{"role": "user", "content": "Answer with a number."}], info={"invalid": 1})
        if guess == self.secret:
            return Step([], reward=1.0, done=True)
        return Step([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])
