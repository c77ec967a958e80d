"""verl_ds.agent.episodes: trajectories grow by the sampled ids and the template's deltas only, every limit and
every environment failure ends one trajectory with its reason while the others go on. The policy here is a
scripted one (it reads its conversation and answers as a tool-using model would); the environments, tokenizer and
template are real."""
import os
import re
import time

import pytest

from chat_testutil import chat_tokenizer
from e2e_utils import ROOT
from verl_ds.agent import Environment, Step, make_environment
from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.episodes import EpisodeLimits, run_episodes
from verl_ds.agent.tasks import calc_samples

TOK = chat_tokenizer("chatml")
STOP = TOK.convert_tokens_to_ids("<|im_end|>")


def scripted(turn_text):
    """generate(): each row's next turn from its conversation text; log-probs -0.5 per token."""
    def generate(prompts, max_new):
        out = []
        for ids in prompts:
            text = turn_text(TOK.decode(ids))
            turn = TOK.encode(text, add_special_tokens=False)[:max_new]
            turn = turn + [STOP] if len(turn) < max_new and text is not None else turn
            out.append((turn, [-0.5] * len(turn)))
        return out
    return generate


def tool_user(text):
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if responses:
        return responses[-1]
    expression = re.findall(r"What is (.*?)\?", text)[-1]
    return f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def test_a_tool_episode_is_the_sampled_ids_and_the_deltas():
    chat = ChatTokens(TOK, make_environment("calc").tools.schemas)
    rows = calc_samples(3, seed=0)
    envs = [make_environment("calc") for _ in rows]
    trajs = run_episodes(scripted(tool_user), chat, envs, rows, EpisodeLimits(max_turn_tokens=128))
    for t, row in zip(trajs, rows):
        assert (t.end, t.reward, t.turns, t.tool_calls, t.tool_errors) == ("done", 1.0, 2, 1, 0), t
        call = tool_user(f"What is {row['expression']}?")
        turn1 = TOK.encode(call, add_special_tokens=False) + [STOP]
        delta = chat.after_turn([{"role": "tool", "name": "calc", "tool_call_id": "call0", "content": row["answer"]}])
        turn2 = TOK.encode(row["answer"], add_special_tokens=False) + [STOP]
        assert t.ids == turn1 + delta + turn2
        assert t.model_mask == [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
        assert t.log_probs == [-0.5] * len(turn1) + [0.0] * len(delta) + [-0.5] * len(turn2)
        # and the same ids as the template renders the whole conversation (this template allows it)
        messages = envs[0].reset(row) + [{"role": "assistant", "content": call},
                                         {"role": "tool", "content": row["answer"]},
                                         {"role": "assistant", "content": row["answer"]}]
        whole = TOK.apply_chat_template(messages, tools=chat.tools, tokenize=False)
        assert TOK.decode(t.prompt_ids + t.ids) + "\n" == whole


class Raises(Environment):
    def reset(self, sample):
        return [{"role": "user", "content": "go"}]

    def step(self, turn):
        raise RuntimeError("environment bug")


class Hangs(Raises):
    def step(self, turn):
        time.sleep(3)


class Garbage(Raises):
    def step(self, turn):
        return {"reward": 1.0}


class NaNReward(Raises):
    def step(self, turn):
        return Step([], reward=float("nan"))


class BadMessages(Raises):
    def step(self, turn):
        return Step([{"content": "no role"}])


class GarbageReset(Raises):
    def reset(self, sample):
        return 42


class HangsAtReset(Raises):
    def reset(self, sample):
        time.sleep(3)


def test_environment_failures_end_only_their_trajectory():
    envs = [Raises(), Hangs(), Garbage(), NaNReward(), BadMessages(), GarbageReset(), HangsAtReset(),
            make_environment("guess_number")]
    rows = [{}] * 7 + [{"secret": 3, "high": 4}]
    guesses = iter(["1", "3"])

    def turn(text):
        return next(guesses) if "I think of a number" in text else "x"
    start = time.monotonic()
    trajs = run_episodes(scripted(turn), ChatTokens(TOK), envs, rows, EpisodeLimits(step_timeout_s=1.0))
    assert time.monotonic() - start < 2.9  # the hung reset and step were each abandoned at their 1 s timeout
    assert [t.end for t in trajs] == ["env_error", "env_timeout", "env_error", "env_error", "env_error", "env_error",
                                      "env_timeout", "done"]
    assert "RuntimeError: environment bug" in trajs[0].reason and "expected a Step" in trajs[2].reason
    assert "cannot be rendered" in trajs[4].reason
    assert "reset returned 42, which the chat template cannot render" in trajs[5].reason
    assert trajs[5].prompt_ids == [] and trajs[6].prompt_ids == []
    assert trajs[7].reward == 1.0 and trajs[7].turns == 2


def test_a_step_that_never_returns_does_not_hold_the_process_at_exit(tmp_path):
    """The abandoned step's thread is a daemon: the process ends when its work is done, not when the step does."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(
        "import time\n"
        "from chat_testutil import chat_tokenizer\n"
        "from verl_ds.agent import Environment\n"
        "from verl_ds.agent.chat_tokens import ChatTokens\n"
        "from verl_ds.agent.episodes import EpisodeLimits, run_episodes\n"
        "class Forever(Environment):\n"
        "    def reset(self, sample):\n"
        "        return [{'role': 'user', 'content': 'go'}]\n"
        "    def step(self, turn):\n"
        "        time.sleep(3600)\n"
        "tok = chat_tokenizer('chatml')\n"
        "stop = tok.convert_tokens_to_ids('<|im_end|>')\n"
        "trajs = run_episodes(lambda prompts, n: [([stop], [-0.1]) for _ in prompts], ChatTokens(tok), [Forever()],\n"
        "                     [{}], EpisodeLimits(step_timeout_s=0.2))\n"
        "print(trajs[0].end)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), ROOT])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "env_timeout" and time.monotonic() - start < 60


def test_limits_end_episodes_with_their_reason():
    env = lambda: make_environment("guess_number")  # noqa: E731
    wrong = scripted(lambda text: "1")
    trajs = run_episodes(wrong, ChatTokens(TOK), [env()], [{"secret": 9, "high": 16}], EpisodeLimits(max_turns=3))
    assert (trajs[0].end, trajs[0].turns, trajs[0].reward) == ("max_turns", 3, 0.0)
    rambling = scripted(lambda text: "1 " * 100)
    trajs = run_episodes(rambling, ChatTokens(TOK), [env()], [{"secret": 9, "high": 16}],
                         EpisodeLimits(max_turn_tokens=16))
    assert trajs[0].end == "turn_length" and len(trajs[0].ids) == 16 and sum(trajs[0].model_mask) == 16
    trajs = run_episodes(wrong, ChatTokens(TOK), [env()], [{"secret": 9, "high": 16}],
                         EpisodeLimits(max_turns=50, max_context_tokens=200, max_turn_tokens=8))
    t = trajs[0]
    assert t.end == "context" and len(t.prompt_ids) + len(t.ids) + 8 > 200 and 1 < t.turns < 50
    calls = scripted(lambda text: '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>')
    trajs = run_episodes(calls, ChatTokens(TOK), [make_environment("calc")], [{"question": "?", "answer": "2"}],
                         EpisodeLimits(max_turns=10, max_tool_calls=2, max_turn_tokens=128))
    assert (trajs[0].end, trajs[0].tool_calls) == ("max_tool_calls", 3)


def test_bad_limits_and_mismatched_inputs_are_named():
    with pytest.raises(ValueError, match="EpisodeLimits.max_turns must be a positive number"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="2 environments for 1 samples"):
        run_episodes(scripted(lambda t: "1"), ChatTokens(TOK), [Raises(), Raises()], [{}])


def test_a_real_engine_turn_by_turn_keeps_its_sampled_ids():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ds.agent.episodes import engine_turns
    from verl_ds.generation import HFRolloutEngine

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    engine = HFRolloutEngine(model, pad_token_id=TOK.pad_token_id, eos_token_id=STOP, gather_params=False)
    calls = []

    def recording(prompts, max_new):
        torch.manual_seed(len(calls))
        out = engine_turns(engine, TOK.pad_token_id, temperature=1.0)(prompts, max_new)
        calls.append((prompts, out))
        return out
    rows = [{"secret": 5, "high": h} for h in (8, 9, 10)]  # distinct prompts: a turn is matched to its row
    # the untrained model rarely emits the stop token: let turn_length end most; bias it towards the stop token
    with torch.no_grad():
        model.lm_head.weight[STOP] += 2.0
    trajs = run_episodes(recording, ChatTokens(TOK), [make_environment("guess_number") for _ in rows], rows,
                         EpisodeLimits(max_turns=3, max_turn_tokens=12))
    assert calls
    for t in trajs:
        assert t.end in ("done", "max_turns", "turn_length") and 1 <= t.turns <= 3
        # every model turn in the trajectory is exactly what the engine returned for that row, log-probs included
        sampled = [(ids, lp) for prompts, out in calls for p, (ids, lp) in zip(prompts, out)
                   if p == (t.prompt_ids + t.ids)[:len(p)]]
        got = [tok for tok, m in zip(t.ids, t.model_mask) if m]
        assert got == [tok for ids, _ in sampled for tok in ids]
        assert [lp for lp, m in zip(t.log_probs, t.model_mask) if m] == [x for _, lp in sampled for x in lp]
        assert all(lp <= 0.0 for lp in t.log_probs)
