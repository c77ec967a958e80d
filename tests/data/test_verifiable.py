"""verl_ds.verifiable: math-verify answer reward and format reward, hand cases, errors, threads."""
import importlib.util
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from verl_ds.rewards import REWARD_FNS, RewardBatch, get_reward_fn
from verl_ds.verifiable import DEFAULT_FORMAT_PATTERN, format_reward, make_format_reward, math_answer_reward

# the math extra (pip install 'verl_ds[math]') is part of the dev install; without it only these skip
needs_math = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                reason="math-verify is not installed (pip install 'verl_ds[math]')")

# (response, reference answer, expected reward)
MATH_CASES = [
    ("The answer is \\boxed{\\frac{1}{2}}", "1/2", 1.0),          # latex vs plain fraction
    ("so x = 0.5", "\\frac{1}{2}", 1.0),                           # decimal vs latex
    ("We get $\\frac{2}{4}$", "0.5", 1.0),                          # unreduced fraction
    ("<think>maybe 3, or 7</think> The result is \\boxed{7}.", "7", 1.0),  # numbers in the reasoning ignored
    ("<think>it is 7</think> The result is \\boxed{3}.", "7", 0.0),
    ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),                         # equal expressions
    ("\\boxed{1+x}", "x+1", 1.0),
    ("\\boxed{1234}", "1,234", 1.0),
    ("Natalia sold 72 clips. #### 72", "She sold 48 + 24 = 72 clips. #### 72", 1.0),  # GSM8K-style reference
    ("the answer is 73", "72", 0.0),                                # wrong answer
    ("\\boxed{-3}", "3", 0.0),
    ("I do not know.", "3", 0.0),                                   # no answer at all
    ("", "2", 0.0),
    ("\\boxed{0.5}", 0.5, 1.0),                                     # a numeric answer field
]


@needs_math
def test_math_answer_reward_hand_cases():
    responses = [r for r, _, _ in MATH_CASES]
    batch = RewardBatch({"answer": [a for _, a, _ in MATH_CASES]})
    got = math_answer_reward(["q"] * len(responses), responses, batch)
    assert got == [e for _, _, e in MATH_CASES]


@needs_math
def test_math_answer_reward_is_shipped_and_thread_safe():
    assert get_reward_fn("math_verify") is math_answer_reward and REWARD_FNS["format"] is format_reward
    responses = [r for r, _, _ in MATH_CASES]
    batch = RewardBatch({"answer": [a for _, a, _ in MATH_CASES]})
    expected = [e for _, _, e in MATH_CASES]
    names = []

    def score(i):
        names.append(threading.current_thread().name)
        return math_answer_reward(["q"] * len(responses), responses, batch)

    with ThreadPoolExecutor(max_workers=4) as pool:  # real worker threads: no SIGALRM timeout there
        results = list(pool.map(score, range(8)))
    assert results == [expected] * 8
    assert threading.main_thread().name not in names


@needs_math
@pytest.mark.parametrize("batch, message", [
    (RewardBatch({"target": ["1"]}), r"math_verify: needs the data set's 'answer' field passed through "
                                     r"\(batch.extras\['answer'\]\); extras has \['target'\]"),
    (None, r"math_verify: needs the data set's 'answer' field .* extras has \[\]"),
    (RewardBatch({"answer": ["1", "2"]}), "math_verify: got 2 answers for 1 responses"),
    (RewardBatch({"answer": [""]}), "math_verify: sample 0: the answer field is empty"),
    (RewardBatch({"answer": ["}{"]}), r"math_verify: sample 0: the answer field '\}\{' could not be parsed as math"),
])
def test_math_answer_reward_errors(batch, message):
    with pytest.raises(ValueError, match=message):
        math_answer_reward(["q"], ["\\boxed{1}"], batch)


def test_math_answer_reward_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what Python does for a package that is absent
    with pytest.raises(ImportError, match=r"pip install 'verl_ds\[math\]'"):
        math_answer_reward(["q"], ["\\boxed{1}"], RewardBatch({"answer": ["1"]}))


FORMAT_CASES = [
    ("<think>2 + 2 is 4</think> The answer is \\boxed{4}.", 1.0),
    ("  <think>\nsteps\n</think>\n\\boxed{\\frac{1}{2}}\n", 1.0),   # whitespace around, nested braces
    ("<think>steps</think>\\boxed{4}", 1.0),
    ("The answer is \\boxed{4}.", 0.0),                                # no reasoning block
    ("<think>steps</think> The answer is 4.", 0.0),                    # no \boxed
    ("<think>steps</think> \\boxed{}", 0.0),                           # empty \boxed
    ("<think>steps</think> \\boxed{} or \\boxed{4}", 0.0),             # the first box is empty
    ("<think>a</think> " + "\\boxed{1} " * 3000 + "<think>", 0.0),     # degenerate: many boxes, a late tag
    ("<think>a</think> " + "\\boxed{" * 3000, 0.0),                      # degenerate: boxes never closed
    ("<think>  </think> \\boxed{4}", 0.0),                             # empty reasoning
    ("<think>a</think> \\boxed{4} <think>b</think>", 0.0),             # a second think block
    ("<think>a <think> b</think> \\boxed{4}", 0.0),                    # nested think tag
    ("<think>\\boxed{4}</think> so four", 0.0),                        # the box inside the reasoning
    ("<think>unfinished reasoning " + "x " * 20000, 0.0),             # long and unclosed: still answered
]


@pytest.mark.parametrize("response, expected", FORMAT_CASES)
def test_format_reward_default_pattern(response, expected):
    assert format_reward(["p"], [response], None) == [expected]


def test_custom_format_and_errors():
    answer_tags = make_format_reward(r"\s*<answer>.+</answer>\s*")
    assert answer_tags(["p", "p"], ["<answer>5</answer>", "5"], None) == [1.0, 0.0]
    assert make_format_reward(DEFAULT_FORMAT_PATTERN)(["p"], ["<think>a</think>\\boxed{1}"]) == [1.0]
    with pytest.raises(ValueError, match=r"format pattern '\(unclosed' is not a valid regular expression"):
        make_format_reward("(unclosed")
    with pytest.raises(TypeError, match="format pattern must be a str"):
        make_format_reward(None)
    with pytest.raises(ValueError, match="format: got 2 prompts but 1 responses"):
        format_reward(["a", "b"], ["x"], None)
    with pytest.raises(TypeError, match="format: response 0 must be a str, got int"):
        format_reward(["a"], [3], None)
