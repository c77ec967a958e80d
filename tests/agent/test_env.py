"""verl_ds.agent.env and tasks: the registry (built-in, user classes by path, clear errors), the tool-calling
environment's steps on hand-written turns, and the built-in tasks' rewards against hand-computed answers."""
import sys
import textwrap

import pytest

from verl_ds.agent import Environment, Step, make_environment, register_environment
from verl_ds.agent.tasks import calc_samples, guess_samples, last_integer

CALL = '<tool_call>{{"name": "calc", "arguments": {{"expression": "{}"}}}}</tool_call>'


def test_calc_episode_tool_then_answer():
    env = make_environment("calc")
    row = {"question": "What is 4821 * 37?", "answer": "178377"}
    first = env.reset(row)
    assert first[-1] == {"role": "user", "content": "What is 4821 * 37?"}
    step = env.step("I will compute. " + CALL.format("4821 * 37"))
    assert not step.done and step.reward == 0.0 and step.info == {"tool_calls": 1, "tool_errors": 0}
    assert step.messages == [{"role": "tool", "name": "calc", "tool_call_id": "call0", "content": "178377"}]
    final = env.step("178377")
    assert final.done and final.reward == 1.0
    assert make_environment("calc").tools.schemas[0]["function"]["name"] == "calc"


def test_calc_bad_calls_are_messages_and_wrong_answers_score_zero():
    env = make_environment("calc")
    env.reset({"question": "What is 2 + 2?", "answer": "4"})
    step = env.step(CALL.format("2 +") + '<tool_call>{"name": "calculator", "arguments": {}}</tool_call><tool_call>{')
    assert not step.done and step.info == {"tool_calls": 3, "tool_errors": 3}
    assert [m["content"].split(":")[0] for m in step.messages] == ["Error"] * 3
    assert "unknown tool 'calculator'" in step.messages[1]["content"]
    assert env.step("The answer is 5").reward == 0.0


def test_guess_number_feedback_until_right():
    env = make_environment("guess_number")
    assert "from 1 to 16" in env.reset({"secret": 11, "high": 16})[0]["content"]
    assert env.step("8").messages == [{"role": "user", "content": "higher"}]
    assert env.step("My guess: 12").messages == [{"role": "user", "content": "lower"}]
    assert env.step("no idea").info == {"invalid": 1}
    last = env.step("11")
    assert last.done and last.reward == 1.0 and last.messages == []


def test_samples_are_reproducible_and_right():
    rows = calc_samples(50, seed=3)
    assert rows == calc_samples(50, seed=3) and rows != calc_samples(50, seed=4)
    for row in rows:
        a, op, b = row["expression"].split()
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert 100 <= int(b) <= int(a) <= 9999
    assert all(1 <= r["secret"] <= 16 for r in guess_samples(100, seed=0))
    with pytest.raises(ValueError, match="digits"):
        calc_samples(3, 0, digits=(4, 2))


@pytest.mark.parametrize("text, value", [("42", 42), ("it is -7, or 8", 8), ("none", None), ("x=1000000", 1000000)])
def test_last_integer(text, value):
    assert last_integer(text) == value


def test_unknown_names_and_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"unknown environment 'gues_number'.*Did you mean 'guess_number'"):
        make_environment("gues_number")
    with pytest.raises(ValueError, match="environment 'calc': its arguments \\['depth'\\] do not fit"):
        make_environment("calc", {"depth": 3})
    with pytest.raises(ValueError, match="tool_format 'xml' is unknown"):
        make_environment("calc", {"tool_format": "xml"})
    with pytest.raises(ValueError, match="cannot load 'Nope'"):
        make_environment("verl_ds.agent.tasks:Nope")
    with pytest.raises(ValueError, match="not a subclass of verl_ds.agent.Environment"):
        make_environment("verl_ds.agent.tasks:calc_samples")
    with pytest.raises(TypeError, match="not a subclass"):
        register_environment("thing")(dict)


def test_a_user_class_from_its_own_package(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent('''
        from verl_ds.agent import Environment, Step

        class Echo(Environment):
            def __init__(self, word="hi"):
                self.word = word

            def reset(self, sample):
                return [{"role": "user", "content": sample["prompt"]}]

            def step(self, turn):
                return Step([], reward=float(turn.strip() == self.word), done=True)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_environment("my_envs:Echo", {"word": "yes"})
    assert env.reset({"prompt": "say yes"}) == [{"role": "user", "content": "say yes"}]
    assert env.step(" yes ").reward == 1.0
    sys.modules.pop("my_envs", None)


def test_registering_a_taken_name_is_refused():
    @register_environment("test_only_env")
    class A(Environment):
        pass

    with pytest.raises(ValueError, match="already registered"):
        @register_environment("test_only_env")
        class B(Environment):
            pass
    assert isinstance(Step([]), Step)
