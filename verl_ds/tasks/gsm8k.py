"""GSM8K-style word problems: the shipped mini set and the exact-match reward. `data/gsm8k_mini.jsonl` holds 42
short problems written for this repo (not taken from GSM8K), every word in the built-in vocabulary; real GSM8K
files work too (an answer "... #### 72" is reduced to its final number)."""
from __future__ import annotations

import json
import os
import re
from decimal import Decimal, InvalidOperation

from verl_ds.verifiable import check_lists, extras_field

MINI_PATH = os.path.join(os.path.dirname(__file__), "data", "gsm8k_mini.jsonl")
INSTRUCTION = "Answer with #### and the final number."
# A thousands-grouped number ("1,234") or plain digits, optional sign and decimals.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
MAX_DIGITS = 600  # a number with more digits (or a smaller or larger exponent) is not an answer


def load_mini(path: str = MINI_PATH) -> list[dict]:
    """The shipped problems as a list of {"question", "answer"} dicts."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def with_instruction(question: str) -> str:
    """`question` followed by the answer-format instruction."""
    return f"{question} {INSTRUCTION}"


def normalize_number(text) -> str | None:
    """Canonical form of a number ('1,200.50' -> '1200.5', '-0' -> '0'); None past MAX_DIGITS or for no number."""
    if isinstance(text, bool) or text is None:
        return None
    text = str(text).strip().replace(",", "").lstrip("$").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    # model text is hostile: int() of a huge number raises (sys.int_max_str_digits) or is slow; no answer is that long
    if not value.is_finite() or abs(value.adjusted()) >= MAX_DIGITS:  # adjusted(): digits before the point - 1
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The first number after the last '####' if there is one, else the last number; normalised, or None."""
    if "####" in text:
        match = _NUMBER.search(text.rsplit("####", 1)[1])
        return normalize_number(match.group()) if match else None
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def reference_answer(answer) -> str | None:
    """The reference from a data set's answer field: a number, a numeric string, or GSM8K's '... #### 72'."""
    if isinstance(answer, str) and "####" in answer:
        return extract_answer(answer)
    return normalize_number(answer)


def exact_match_reward(prompts: list[str], responses: list[str], batch) -> list[float]:
    """1.0 where the response's final number equals the sample's `answer` field (batch.extras["answer"]), else 0.0."""
    check_lists("exact_match", prompts, responses)
    answers = extras_field("exact_match", responses, batch, "answer", "answers")
    rewards = []
    for i, (response, answer) in enumerate(zip(responses, answers)):
        reference = reference_answer(answer)
        if reference is None:
            raise ValueError(f"exact_match: sample {i}: answer field {answer!r:.80} is not a number")
        rewards.append(1.0 if extract_answer(response) == reference else 0.0)
    return rewards
