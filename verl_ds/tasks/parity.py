"""The default task: answer "even : 3 8 1 5 =>" with digits of the requested parity (the distractor digits make the
policy read the instruction); the reward is the fraction of the first `length` words that are digits of that parity.
Without an SFT warm start build the tokenizer from `VOCAB`: a near-uniform model then hits a digit far more often
(figures: benchmarks/README.md, "Measurements behind defaults")."""
from __future__ import annotations

import json
import os
import random

from verl_ds.verifiable import check_lists

RESPONSE_LENGTH = 6  # L: the number of response words that are scored
TARGETS = ("even", "odd")
GOOD_DIGITS = {"even": ("0", "2", "4", "6", "8"), "odd": ("1", "3", "5", "7", "9")}
VOCAB = [str(d) for d in range(10)] + ["even", "odd", ":", "=>"]  # all the task needs (specials are added)
_EOS = "<eos>"


def make_prompt(target: str, context: list[int]) -> str:
    """'even : 3 8 1 5 =>' for target 'even' and context [3, 8, 1, 5]."""
    return f"{target} : {' '.join(str(d) for d in context)} =>"


def generate_prompts(n: int, seed: int, context_len: tuple[int, int] = (2, 6)) -> list[dict]:
    """`n` records {"prompt": str, "target": "even" | "odd"}; the same (n, seed) always gives the same list."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    lo, hi = context_len
    if not 0 <= lo <= hi:
        raise ValueError(f"context_len: expected (min, max) with 0 <= min <= max, got {context_len!r}")
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        target = rng.choice(TARGETS)
        context = [rng.randrange(10) for _ in range(rng.randint(lo, hi))]
        records.append({"prompt": make_prompt(target, context), "target": target})
    return records


def write_jsonl(path: str, n: int, seed: int) -> str:
    """Write `generate_prompts(n, seed)` as JSON lines to `path` (parents created); returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in generate_prompts(n, seed):
            f.write(json.dumps(record) + "\n")
    return path


def sft_examples(n: int, seed: int, length: int = RESPONSE_LENGTH) -> list[tuple[str, str]]:
    """`n` (prompt, response) pairs with optimal responses ('2 8 0 4 4 6'); the caller appends EOS if wanted."""
    rng = random.Random(seed + 1)  # not the prompt stream, so responses don't mirror the context digits
    pairs = []
    for record in generate_prompts(n, seed):
        good = GOOD_DIGITS[record["target"]]
        pairs.append((record["prompt"], " ".join(rng.choice(good) for _ in range(length))))
    return pairs


def target_of(prompt: str) -> str | None:
    """The first instruction word (even/odd) in `prompt`, or None."""
    return next((w for w in prompt.split() if w in TARGETS), None)


def score(response: str, target: str, length: int = RESPONSE_LENGTH) -> float:
    """Fraction of the first `length` words that are digits of parity `target`; missing or after '<eos>': 0."""
    words = response.split()
    if _EOS in words:
        words = words[:words.index(_EOS)]
    good = GOOD_DIGITS[target]
    return sum(w in good for w in words[:length]) / length


def parity_reward(prompts: list[str], responses: list[str], batch=None,
                  length: int = RESPONSE_LENGTH) -> list[float]:
    """`score` per sample against `batch.extras["target"]`, else the prompt's instruction word."""
    check_lists("parity_reward", prompts, responses)
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"parity_reward: length: expected a positive int, got {length!r}")
    extras = getattr(batch, "extras", None) or {}
    targets = extras.get("target") or [None] * len(prompts)
    rewards = []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        target = targets[i] if targets[i] in TARGETS else target_of(prompt)
        if target is None:
            raise ValueError(f"parity_reward: sample {i}: no 'target' field and no instruction word "
                             f"({'/'.join(TARGETS)}) in prompt {prompt!r:.120}")
        rewards.append(score(response, target, length))
    return rewards


def demonstrations(tokenizer, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` (ids, mask) warm-up demonstrations of `sft_examples`, trained on every token after the first (LM loss)."""
    ids = [tokenizer(prompt + " " + response)["input_ids"] for prompt, response in sft_examples(n, seed=seed)]
    return [(x, [0] + [1] * (len(x) - 1)) for x in ids]


def preference_pairs(n: int, seed: int, candidates: int = 4, length: int = RESPONSE_LENGTH) -> list[dict]:
    """Preference rows {"prompt", "chosen", "rejected"} (TRL's names) for `generate_prompts(n, seed)`: per prompt the
    best and worst by `score` of `candidates` random responses (all tied: redrawn); deterministic in (n, seed)."""
    if not isinstance(candidates, int) or candidates < 2:
        raise ValueError(f"candidates: expected an int >= 2, got {candidates!r}")
    rng = random.Random(seed + 2)  # a stream of its own: not the prompts', not sft_examples'
    rows = []
    for record in generate_prompts(n, seed):
        target = record["target"]
        good, bad = GOOD_DIGITS[target], GOOD_DIGITS["odd" if target == "even" else "even"]
        scored = [(0.0, "")]
        while scored[0][0] == scored[-1][0]:
            scored = []
            for _ in range(candidates):
                p_good = rng.random()
                words = [rng.choice(good if rng.random() < p_good else bad)
                         for _ in range(rng.randint(max(1, length - 2), length))]
                scored.append((score(" ".join(words), target, length), " ".join(words)))
            scored.sort(key=lambda s: s[0])
        rows.append({"prompt": record["prompt"], "chosen": scored[-1][1], "rejected": scored[0][1]})
    return rows
