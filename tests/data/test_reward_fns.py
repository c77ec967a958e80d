"""Shipped reward functions (parity, exact_match), the tasks' generators, and the reward registry/loader."""
import pytest

from verl_ds.data import PromptDataset
from verl_ds.rewards import (REWARD_FNS, RewardBatch, get_reward_fn, load_reward_fn, register_reward_fn,
                             resolve_reward_fn)
from verl_ds.tasks import gsm8k, parity
from verl_ds.tokenizer import build_tokenizer


# ---------------------------------------------------------------- parity

@pytest.mark.parametrize("response, target, expected", [
    ("2 4 6 8 0 2", "even", 1.0),
    ("1 3 5 7 9 1", "odd", 1.0),
    ("1 3 5 7 9 1", "even", 0.0),
    ("2 3 4 5 6 7", "even", 3 / 6),
    ("2 4", "even", 2 / 6),  # stopped early: the missing words fail
    ("2 4 <eos> 6 8 0 2", "even", 2 / 6),  # decoded without skipping special tokens
    ("2 4 6 8 0 2 1 1 1", "even", 1.0),  # words after the first L do not count
    ("1 1 1 1 1 1 2 2", "even", 0.0),
    ("24 6 even 8 <unk> 2", "even", 3 / 6),  # '24' is not a single digit
    ("", "odd", 0.0),
    ("  7\t9\n3 ", "odd", 3 / 6),
])
def test_parity_score_hand_cases(response, target, expected):
    assert parity.score(response, target) == pytest.approx(expected, abs=0)
    assert parity.parity_reward([parity.make_prompt(target, [1, 2])], [response]) == [pytest.approx(expected, abs=0)]


def test_parity_length_and_target_sources():
    assert parity.parity_reward(["even : 1 =>"], ["2 4 1"], None, length=3) == [pytest.approx(2 / 3)]
    # the target field wins over the prompt; without it the instruction word is found even after a chat template
    batch = RewardBatch({"target": ["odd", None]})
    assert parity.parity_reward(["even : 1 =>", "user : odd : 4 => assistant :"], ["1 3 5 7 9 1", "1 3 5 7 9 1"],
                                batch) == [1.0, 1.0]


@pytest.mark.parametrize("call, message", [
    (lambda: parity.parity_reward(["2 4 =>"], ["2"]), r"parity_reward: sample 0: no 'target' field and no "
                                                       r"instruction word \(even/odd\) in prompt '2 4 =>'"),
    (lambda: parity.parity_reward(["even"], []), "parity_reward: got 1 prompts but 0 responses"),
    (lambda: parity.parity_reward(["even"], ["2"], None, length=0), "length: expected a positive int, got 0"),
    (lambda: parity.generate_prompts(0, 0), "n: expected a positive int, got 0"),
    (lambda: parity.generate_prompts(3, 0, context_len=(4, 2)), r"context_len: expected \(min, max\)"),
])
def test_parity_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_parity_generators(tmp_path):
    records = parity.generate_prompts(200, seed=4)
    assert records == parity.generate_prompts(200, seed=4) != parity.generate_prompts(200, seed=5)
    assert {r["target"] for r in records} == {"even", "odd"}
    for r in records:
        assert parity.target_of(r["prompt"]) == r["target"] and r["prompt"].endswith(" =>")
        assert 2 <= len(r["prompt"].split()) - 3 <= 6
    pairs = parity.sft_examples(50, seed=4)
    assert [p for p, _ in pairs] == [r["prompt"] for r in parity.generate_prompts(50, seed=4)]
    assert parity.parity_reward([p for p, _ in pairs], [r for _, r in pairs]) == [1.0] * 50
    assert len({r for _, r in pairs}) > 40  # varied, not one memorised answer
    path = parity.write_jsonl(str(tmp_path / "sub" / "p.jsonl"), 30, seed=1)
    ds = PromptDataset.from_file(path, build_tokenizer(parity.VOCAB))
    assert len(ds) == 30 and ds[0]["target"] == parity.generate_prompts(30, seed=1)[0]["target"]


# ---------------------------------------------------------------- exact match

@pytest.mark.parametrize("response, answer, expected", [
    ("#### 42", "42", 1.0),
    ("3 + 5 = 8 so #### 8", "8", 1.0),
    ("first 40 then 42", "42", 1.0),  # no ####: the last number
    ("#### 42 and then 7", "42", 1.0),  # after ####: the first number
    ("maybe 42 #### 41", "42", 0.0),
    ("#### 1,200", "1200", 1.0),
    ("It costs $1,200.00 in total", "1200", 1.0),
    ("#### 1200", "1,200", 1.0),
    ("#### -5", "-5", 1.0),
    ("the change is -5", "5", 0.0),
    ("#### 5", "-5", 0.0),
    ("The answer is 7.", "7", 1.0),
    ("#### 7.0", "7", 1.0),
    ("#### 2.50", "2.5", 1.0),
    ("#### 2.5", "2", 0.0),
    ("1,2,3", "3", 1.0),
    ("no number here", "4", 0.0),
    ("12 apples #### none", "12", 0.0),
    ("", "0", 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K's answer format
    ("#### 48", 48, 1.0),  # a numeric column (Parquet)
    ("#### 0", "-0", 1.0),
])
def test_exact_match_cases(response, answer, expected):
    assert gsm8k.exact_match_reward(["q"], [response], RewardBatch({"answer": [answer]})) == [expected]


@pytest.mark.parametrize("response", [
    "#### " + "1" * 5000,  # int() of over 4300 digits raised ValueError (sys.int_max_str_digits): the step failed
    "7 " + "9" * 1_000_000,  # int() of it held the GIL for most of a minute, then raised the same
    "#### 1." + "0" * 100_000,
    "#### 0." + "0" * 700 + "1",
])
def test_exact_match_on_hostile_numbers(response):
    assert gsm8k.exact_match_reward(["q"], [response], RewardBatch({"answer": ["72"]})) == [0.0]
    assert gsm8k.normalize_number("9" * 600) == "9" * 600 and gsm8k.normalize_number("9" * 601) is None


def test_exact_match_through_the_builtin_tokenizer():
    tok = build_tokenizer()
    decoded = tok.decode(tok("He has 108 cookies . #### 108")["input_ids"])
    assert gsm8k.exact_match_reward(["q"], [decoded], RewardBatch({"answer": ["108"]})) == [1.0]


@pytest.mark.parametrize("text, expected", [
    ("1,234", "1234"), ("$5", "5"), ("+3", "3"), ("10.500", "10.5"), ("100", "100"), ("1e2", "100"),
    ("abc", None), (None, None), (True, None), ("nan", None), ("inf", None), (7, "7"), (2.0, "2"),
    ("1e599", "1" + "0" * 599), ("1e600", None), ("1e-600", None),  # a billion-digit int() is never tried
])
def test_normalize_number(text, expected):
    assert gsm8k.normalize_number(text) == expected


@pytest.mark.parametrize("extras, responses, message", [
    ({}, ["1"], r"needs the data set's 'answer' field passed through .*extras has \[\]"),
    ({"answer": ["seven"]}, ["7"], "exact_match: sample 0: answer field 'seven' is not a number"),
    ({"answer": [None]}, ["7"], "exact_match: sample 0: answer field None is not a number"),
    ({"answer": ["1", "2"]}, ["7"], "exact_match: got 2 answers for 1 responses"),
])
def test_exact_match_errors(extras, responses, message):
    with pytest.raises(ValueError, match=message):
        gsm8k.exact_match_reward(["q"] * len(responses), responses, RewardBatch(extras))


def test_gsm8k_mini_file():
    rows = gsm8k.load_mini()
    assert len(rows) >= 40
    assert all(set(r) == {"question", "answer"} and gsm8k.normalize_number(r["answer"]) == r["answer"] for r in rows)
    assert len({r["question"] for r in rows}) == len(rows)
    # the reference answers score 1.0 when written in either response style
    answers = RewardBatch({"answer": [r["answer"] for r in rows]})
    assert gsm8k.exact_match_reward([""] * len(rows), [f"#### {r['answer']}" for r in rows], answers) == \
        [1.0] * len(rows)


# ---------------------------------------------------------------- registry and loader

def test_registry_lookup():
    assert get_reward_fn("parity") is parity.parity_reward
    assert get_reward_fn("exact_match") is gsm8k.exact_match_reward
    assert {"parity", "exact_match"} <= set(REWARD_FNS)
    with pytest.raises(ValueError, match=r"unknown reward function 'pariti'; valid names: \[.*'parity'.*\]\. "
                                         r"Did you mean 'parity'\?"):
        get_reward_fn("pariti")
    with pytest.raises(ValueError, match=r"unknown reward function 'zzz'; valid names: .*\(a user function is"):
        get_reward_fn("zzz")


def test_register_reward_fn():
    def constant(prompts, responses, batch):
        return [0.5] * len(responses)
    try:
        register_reward_fn("test_constant", constant)
        assert get_reward_fn("test_constant") is constant
        with pytest.raises(ValueError, match="reward function name 'test_constant' is already registered"):
            register_reward_fn("test_constant", constant)
    finally:
        REWARD_FNS.pop("test_constant", None)
    with pytest.raises(TypeError, match=r"reward function 'two_args' must accept \(prompts, responses, batch\)"):
        register_reward_fn("two_args", lambda prompts, responses: [])
    assert "two_args" not in REWARD_FNS


USER_FILE = """
THRESHOLD = 3

def my_reward(prompts, responses, batch):
    return [float(len(r.split()) >= THRESHOLD) for r in responses]

def two_args(prompts, responses):
    return []
"""


def test_load_reward_fn_from_file_and_module(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FILE)
    fn = load_reward_fn(f"{path}:my_reward")
    assert fn(["p", "p"], ["a b c", "a"], None) == [1.0, 0.0]
    assert load_reward_fn("verl_ds.tasks.parity:parity_reward") is parity.parity_reward
    assert resolve_reward_fn("exact_match") is gsm8k.exact_match_reward
    assert resolve_reward_fn(f"{path}:my_reward")(["p"], ["a b c"], None) == [1.0]


@pytest.mark.parametrize("spec, error, message", [
    ("{dir}/missing.py:fn", ValueError, r"file '.*missing.py' does not exist"),
    ("{dir}/user_rewards.py:my_rewrd", ValueError, r"has no attribute 'my_rewrd'; did you mean 'my_reward'\?"),
    ("{dir}/user_rewards.py:THRESHOLD", TypeError, r"'THRESHOLD' is a int, not callable"),
    ("{dir}/user_rewards.py:two_args", TypeError, r"must accept \(prompts, responses, batch\)"),
    ("{dir}/broken.py:fn", ValueError, r"executing '.*broken.py' failed: ZeroDivisionError"),
    ("no_such_module_xyz:fn", ValueError, r"module 'no_such_module_xyz' not found"),
    ("verl_ds.tasks.parity:nothing_here", ValueError, r"'verl_ds.tasks.parity' has no attribute 'nothing_here'"),
    ("parity", ValueError, r"expected 'module.path:function' or '/path/file.py:function', got 'parity'"),
    ("module:", ValueError, "expected 'module.path:function'"),
    (":fn", ValueError, "expected 'module.path:function'"),
])
def test_load_reward_fn_errors(tmp_path, spec, error, message):
    (tmp_path / "user_rewards.py").write_text(USER_FILE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    with pytest.raises(error, match=message):
        load_reward_fn(spec.format(dir=tmp_path))
