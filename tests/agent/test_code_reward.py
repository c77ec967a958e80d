"""The code_tests reward: the last code block with the row's asserts, in the sandbox; a hostile answer scores 0
and harms nothing."""
import pytest

from verl_ds.agent.code_reward import code_tests_reward, last_code_block
from verl_ds.rewards import RewardBatch, get_reward_fn

GOOD = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\n"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TWO = "first try:\n```py\ndef add(a, b): return 0\n```\nbetter:\n```\ndef add(a, b):\n    return b + a\n```"


def test_last_code_block():
    assert last_code_block(GOOD) == "def add(a, b):\n    return a + b\n"
    assert last_code_block(TWO) == "def add(a, b):\n    return b + a\n"
    assert last_code_block("no code") is None


def test_scores_against_the_rows_tests(tmp_path):
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
    hostile = f"```python\nopen({str(tmp_path / 'x')!r}, 'w')\nwhile True: pass\n```"
    responses = [GOOD, WRONG, TWO, "the answer is 5", hostile]
    scores = code_tests_reward([""] * 5, responses, RewardBatch({"tests": [tests] * 4 + ["assert True"]}))
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert not (tmp_path / "x").exists()
    assert get_reward_fn("code_tests") is code_tests_reward


def test_missing_tests_are_named():
    with pytest.raises(ValueError, match="code_tests: needs the data set's 'tests' field passed through"):
        code_tests_reward([""], [GOOD], RewardBatch({"answer": ["5"]}))
    with pytest.raises(ValueError, match="code_tests: got 2 rows of tests for 1 responses"):
        code_tests_reward([""], [GOOD], RewardBatch({"tests": ["", ""]}))


EXITS = ["sys.exit(0)", "os._exit(0)", "raise SystemExit(0)", "os.kill(os.getpid(), signal.SIGKILL)",
         "signal.raise_signal(signal.SIGTERM)"]


@pytest.mark.parametrize("where", ["function", "module"])
@pytest.mark.parametrize("exit_", EXITS)
def test_an_exit_before_the_last_assert_scores_0(exit_, where):
    body = f"    {exit_}\n    return a - b" if where == "function" else "    return a - b"
    after = "" if where == "function" else exit_ + "\n"
    answer = f"```python\nimport os, signal, sys\ndef add(a, b):\n{body}\n{after}```"
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
    assert code_tests_reward([""] * 2, [answer, GOOD], RewardBatch({"tests": [tests] * 2})) == [0.0, 1.0]


def test_an_exit_in_the_middle_of_the_tests_scores_0():
    answer = "```python\nimport sys\ndef add(a, b):\n    if a < 0: sys.exit(0)\n    return a + b\n```"
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(1, 1) == 2"]
    assert code_tests_reward([""], [answer], RewardBatch({"tests": [tests]})) == [0.0]

