"""verl_ds.agent.episodes against hostile environments and hostile model turns: a malformed Step, an exit or an
interrupt raised inside the environment, an infinite reward, a turn with more tool calls than the budget, a step
that times out halfway through its calls, arguments JSON cannot take. Each ends one trajectory with its reason (or
becomes an Error: message for the model) while the batch goes on; a Ctrl-C of the trainer itself still stops it.
Real environments, tokenizer and template; the scripted policy of test_episodes."""
import os
import signal
import subprocess
import sys
import threading

import pytest

from e2e_utils import ROOT
from test_episodes import TOK, Raises, scripted
from verl_ds.agent import Step, ToolSet, make_environment
from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.env import ToolEnvironment
from verl_ds.agent.episodes import EpisodeLimits, run_episodes


def _step_returning(**fields):
    class Env(Raises):
        def step(self, turn):
            return Step([{"role": "user", "content": "more"}], **fields)
    return Env


def _raising(where, exc):
    class Env(Raises):
        def reset(self, sample):
            if where == "reset":
                raise exc
            return super().reset(sample)

        def step(self, turn):
            raise exc
    return Env


MALFORMED = {
    "info None": (_step_returning(info=None), "info"),
    "info a list": (_step_returning(info=[("tool_calls", 1)]), "info"),
    "tool_calls a word": (_step_returning(info={"tool_calls": "three"}), "tool_calls"),
    "tool_calls NaN": (_step_returning(info={"tool_calls": float("nan")}), "tool_calls"),
    "tool_calls a bool": (_step_returning(info={"tool_calls": True}), "tool_calls"),
    "tool_calls 2.5": (_step_returning(info={"tool_calls": 2.5}), "tool_calls"),
    "tool_calls negative": (_step_returning(info={"tool_calls": -5}), "tool_calls"),
    "tool_errors a word": (_step_returning(info={"tool_errors": "x"}), "tool_errors"),
    "done a string": (_step_returning(done="no"), "done"),
    "done None": (_step_returning(done=None), "done"),
    "reward inf": (_step_returning(reward=float("inf")), "reward"),
    "reward -inf": (_step_returning(reward=float("-inf")), "reward"),
    "SystemExit in step": (_raising("step", SystemExit(3)), "SystemExit: 3"),
    "KeyboardInterrupt in step": (_raising("step", KeyboardInterrupt()), "KeyboardInterrupt"),
    "SystemExit in reset": (_raising("reset", SystemExit("bye")), "SystemExit: bye"),
    "KeyboardInterrupt in reset": (_raising("reset", KeyboardInterrupt()), "KeyboardInterrupt"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_step_ends_only_its_trajectory(case):
    env_class, named = MALFORMED[case]
    envs = [env_class(), make_environment("guess_number")]
    rows = [{}, {"secret": 3, "high": 4}]
    guesses = iter(["1", "3"])

    def turn(text):
        return next(guesses) if "I think of a number" in text else "x"
    trajs = run_episodes(scripted(turn), ChatTokens(TOK), envs, rows, EpisodeLimits(step_timeout_s=5.0))
    assert trajs[0].end == "env_error" and named in trajs[0].reason, trajs[0]
    assert trajs[0].reward == 0.0  # nothing of the malformed step is kept
    assert (trajs[1].end, trajs[1].reward, trajs[1].turns) == ("done", 1.0, 2)


def test_a_ctrl_c_of_the_trainer_still_stops_the_run(tmp_path):
    """SIGINT reaches the main thread (Python runs signal handlers there only) while it waits on a step: the run
    stops with KeyboardInterrupt instead of the trajectory ending as an environment failure."""
    script = tmp_path / "interrupted.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # an ignored SIGINT is inherited (a test's)\n"
        "from chat_testutil import chat_tokenizer\n"
        "from verl_ds.agent import Environment\n"
        "from verl_ds.agent.chat_tokens import ChatTokens\n"
        "from verl_ds.agent.episodes import EpisodeLimits, run_episodes\n"
        "class Slow(Environment):\n"
        "    def reset(self, sample):\n"
        "        return [{'role': 'user', 'content': 'go'}]\n"
        "    def step(self, turn):\n"
        "        print('stepping', flush=True)\n"
        "        time.sleep(3600)\n"
        "tok = chat_tokenizer('chatml')\n"
        "stop = tok.convert_tokens_to_ids('<|im_end|>')\n"
        "try:\n"
        "    trajs = run_episodes(lambda prompts, n: [([stop], [-0.1]) for _ in prompts], ChatTokens(tok), [Slow()],\n"
        "                         [{}], EpisodeLimits(step_timeout_s=600))\n"
        "    print('finished', trajs[0].end, flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), ROOT])}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "stepping", proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out.strip() == "interrupted", err[-2000:]


class Marking(ToolEnvironment):
    """One tool, ``mark``, that appends its argument to a file: the file shows which calls ran. The first call
    waits for ``release`` when one is given; ``returned`` is set when a step returns, however it ends."""

    def __init__(self, path, release=None):
        def mark(n: int) -> str:
            """Write a mark.

            Args:
                n: The mark.
            """
            if release is not None and n == 0:
                release.wait(60)
            with open(path, "a") as f:
                f.write(f"{n}\n")
            return "ok"
        super().__init__(ToolSet([mark]))
        self.returned = threading.Event()

    def reset(self, sample):
        return [{"role": "user", "content": "mark"}]

    def score(self, answer):
        return 1.0

    def step(self, turn):
        try:
            return super().step(turn)
        finally:
            self.returned.set()


def _marks(n):
    return "".join(f'<tool_call>{{"name": "mark", "arguments": {{"n": {i}}}}}</tool_call>' for i in range(n))


def test_calls_beyond_the_tool_call_budget_never_run(tmp_path):
    """5 calls a turn with a budget of 8: turn 1 runs its 5, turn 2 only 3 of its 5, and the trajectory ends."""
    path = tmp_path / "marks"
    limits = EpisodeLimits(max_turns=10, max_tool_calls=8, max_turn_tokens=1024, max_context_tokens=8192)
    trajs = run_episodes(scripted(lambda text: _marks(5)), ChatTokens(TOK), [Marking(path)], [{}], limits)
    assert (trajs[0].end, trajs[0].turns, trajs[0].tool_calls) == ("max_tool_calls", 2, 10)
    assert path.read_text().split() == ["0", "1", "2", "3", "4", "0", "1", "2"]


def test_a_timed_out_step_starts_no_more_calls(tmp_path):
    """The step's first call is held until its step has timed out; released, it finishes, and none after it runs."""
    path, release = tmp_path / "marks", threading.Event()
    env = Marking(path, release)
    limits = EpisodeLimits(max_tool_calls=100, max_turn_tokens=2048, max_context_tokens=8192, step_timeout_s=0.5)
    try:
        trajs = run_episodes(scripted(lambda text: _marks(20)), ChatTokens(TOK), [env], [{}], limits)
    finally:
        release.set()
    assert trajs[0].end == "env_timeout"
    assert env.returned.wait(60)  # the abandoned step has returned: nothing more can run
    assert path.read_text().split() == ["0"]


DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "9" * 5000


@pytest.mark.parametrize("payload", [DEEP, HUGE], ids=["nested 100000 deep", "5000 digits"])
def test_arguments_json_cannot_take_are_an_error_message(payload):
    """The model reads an Error: tool message and answers; the episode goes on to its end."""
    calls = iter([f'<tool_call>{{"name": "calc", "arguments": {{"expression": {payload}}}}}</tool_call>', "4"])
    chat = ChatTokens(TOK, make_environment("calc").tools.schemas)
    limits = EpisodeLimits(max_turn_tokens=250_000, max_context_tokens=600_000)
    trajs = run_episodes(scripted(lambda text: next(calls)), chat, [make_environment("calc")],
                         [{"question": "What is 2 + 2?", "answer": "4"}], limits)
    t = trajs[0]
    assert (t.end, t.reward, t.turns, t.tool_calls, t.tool_errors) == ("done", 1.0, 2, 1, 1), t
    assert "<tool_response>\nError: tool call 0 " in TOK.decode(t.ids)
