"""Golden tests on the real chat templates of Qwen2.5, Qwen3 and Llama 3.1 (committed verbatim, provenance in
templates/README.md) with byte-level BPE tokenizers built in code (real_templates.py): a conversation built turn
by turn (the model's turns as sampled ids, the environment's messages as template deltas) equals
``apply_chat_template`` over the whole conversation where the template allows it; where it does not (Qwen3 drops
earlier turns' reasoning, a turn's text that the template trims or that merges with the header before it) the
difference is reported by ``rewrites_history`` and the ids built turn by turn keep what the model sampled."""
import hashlib
import json
import re
from collections import Counter

import pytest

from real_templates import FAMILIES, TEMPLATES, real_tokenizer
from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.episodes import EpisodeLimits, run_episodes
from verl_ds.agent.tasks import CalcEnvironment, calc_samples
from verl_ds.agent.tools import ToolSet, calc

TOOLS = ToolSet([calc]).schemas
FORMAT = {"qwen2_5": "hermes", "qwen3": "hermes", "llama3_1": "llama3_json"}
# what a checkpoint of the family writes after its last turn once the conversation is rendered whole
AFTER_LAST_TURN = {"qwen2_5": "\n", "qwen3": "\n", "llama3_1": ""}


def call_text(family: str, expression: str) -> str:
    """A calc call as the family's model writes it (the template's own rendering of a structured call, checked in
    test_the_scripted_tool_calls_are_the_templates_own)."""
    if family == "llama3_1":
        return json.dumps({"name": "calc", "parameters": {"expression": expression}})
    return "<tool_call>\n" + json.dumps({"name": "calc", "arguments": {"expression": expression}}) + "\n</tool_call>"


def reasoned(family: str, reasoning: str, text: str) -> str:
    """A turn with its reasoning, as a Qwen3 checkpoint in thinking mode writes it; other families do not reason."""
    return f"<think>\n{reasoning}\n</think>\n\n{text}" if family == "qwen3" else text


def conversation(family: str) -> list:
    return [
        {"role": "system", "content": "Use the calc tool for arithmetic, then answer with the number only."},
        {"role": "user", "content": "What is 4821 * 37?"},
        {"role": "assistant", "content": reasoned(family, "I need the tool.", call_text(family, "4821 * 37"))},
        {"role": "tool", "name": "calc", "tool_call_id": "call0", "content": "178377"},
        {"role": "assistant", "content": reasoned(family, "The tool says 178377.", "178377")},
        {"role": "user", "content": "And 12 * 12?"},
    ]


def two_calls(family: str) -> list:
    """One turn with two Hermes calls and their two tool messages (Qwen renders them as one user turn)."""
    calls = call_text(family, "65 * 88") + "\n" + call_text(family, "903 + 4417")
    return [
        {"role": "user", "content": "What are 65 * 88 and 903 + 4417?"},
        {"role": "assistant", "content": reasoned(family, "Two calls at once.", calls)},
        {"role": "tool", "name": "calc", "tool_call_id": "call0", "content": "5720"},
        {"role": "tool", "name": "calc", "tool_call_id": "call1", "content": "5320"},
        {"role": "assistant", "content": reasoned(family, "Both are back.", "5720 and 5320")},
        {"role": "user", "content": "Thanks."},
    ]


def ends_in_non_assistant(messages: list) -> list:
    """Every prefix of ``messages`` that ends in a non-assistant message (the points where the model is asked)."""
    return [messages[:n] for n in range(2, len(messages) + 1) if messages[n - 1]["role"] != "assistant"]


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_templates_are_the_checkpoints_verbatim():
    # the git blob ids the README records are those of the upstream files: an edited copy (a stripped trailing
    # newline, a reindented line) would no longer be the checkpoint's template
    readme = (TEMPLATES / "README.md").read_text()
    for family, (name, *_) in FAMILIES.items():
        recorded = re.search(rf"`{re.escape(name)}`.*?blob `([0-9a-f]{{40}})`", readme, re.DOTALL)
        assert recorded, f"templates/README.md does not record {name}'s blob id"
        assert git_blob_id((TEMPLATES / name).read_bytes()) == recorded.group(1), name


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1"])
def test_the_scripted_tool_calls_are_the_templates_own(family):
    # a structured tool call rendered by the template is the text our scripted model emits, so the golden
    # conversations hold the calls a checkpoint of the family was trained to write
    tok = real_tokenizer(family)
    head = conversation(family)[:2]
    structured = head + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expression": "4821 * 37"}}}]}]
    as_text = head + [{"role": "assistant", "content": call_text(family, "4821 * 37")}]
    render = lambda msgs: tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)  # noqa: E731
    assert render(structured) == render(as_text)


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1"])
def test_incremental_equals_whole(family, with_tools):
    tok = real_tokenizer(family)
    chat = ChatTokens(tok, TOOLS if with_tools else None)
    parallel = two_calls(family) if family != "llama3_1" else []  # Llama 3.1 makes one call per turn
    for messages in ends_in_non_assistant(conversation(family)) + ends_in_non_assistant(parallel):
        whole = tok.encode(tok.apply_chat_template(messages, tools=chat.tools, tokenize=False,
                                                   add_generation_prompt=True), add_special_tokens=False)
        assert chat.incremental(messages) == whole, (family, messages[-1])
        assert not chat.rewrites_history(messages)


@pytest.mark.parametrize("with_tools", [False, True])
def test_qwen3_within_one_query_equals_whole(with_tools):
    # Qwen3 keeps the reasoning of the turns after the last user query (a tool-calling chain): no rewrite there
    tok = real_tokenizer("qwen3")
    chat = ChatTokens(tok, TOOLS if with_tools else None)
    for messages in ends_in_non_assistant(conversation("qwen3")[:4]) + ends_in_non_assistant(two_calls("qwen3")[:4]):
        whole = tok.encode(tok.apply_chat_template(messages, tools=chat.tools, tokenize=False,
                                                   add_generation_prompt=True), add_special_tokens=False)
        assert chat.incremental(messages) == whole, len(messages)


@pytest.mark.parametrize("with_tools", [False, True])
def test_qwen3_drops_earlier_reasoning_once_a_new_query_follows_and_it_is_reported(with_tools):
    tok = real_tokenizer("qwen3")
    chat = ChatTokens(tok, TOOLS if with_tools else None)
    messages = conversation("qwen3")
    assert chat.rewrites_history(messages)
    whole, incremental = tok.decode(chat.whole(messages)), tok.decode(chat.incremental(messages))
    # hand-derived: the whole rendering is the sampled conversation without the two turns' reasoning blocks
    dropped = incremental.replace("<think>\nI need the tool.\n</think>\n\n", "")
    dropped = dropped.replace("<think>\nThe tool says 178377.\n</think>\n\n", "")
    assert whole == dropped != incremental
    # the ids the model was given and sampled stay, up to the new query's delta
    prompt = chat.prompt(messages[:2])
    assert chat.incremental(messages)[:len(prompt)] == prompt


def test_a_merge_or_trim_at_the_turn_boundary_is_reported():
    # Qwen2.5: the prompt ends "assistant\n"; a turn that starts with "\n" is one token "\n\n" once re-encoded
    tok = real_tokenizer("qwen2_5")
    assert "ĊĊ" in tok.convert_ids_to_tokens(tok.encode("assistant\n\nHi", add_special_tokens=False))
    chat = ChatTokens(tok)
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHi"},
            {"role": "user", "content": "?"}]
    assert chat.rewrites_history(turn)
    assert chat.rewrites_history([*turn[:1], {"role": "assistant", "content": "Hi"}, turn[2]]) is False
    # Llama 3.1 trims every message: a sampled turn that ends with a newline is not what the whole rendering has
    chat = ChatTokens(real_tokenizer("llama3_1"))
    assert chat.rewrites_history([*turn[:1], {"role": "assistant", "content": "Hi\n"}, turn[2]])
    assert not chat.rewrites_history([*turn[:1], {"role": "assistant", "content": "Hi"}, turn[2]])


def test_llama3_with_end_of_text_as_eos_closes_turns_with_eot():
    # Llama 3 tokenizers whose eos is <|end_of_text|> (the base checkpoints, early Llama-3-Instruct configs) stop
    # generation on <|eot_id|> too; the template closes every turn with <|eot_id|>, so the turn built incrementally
    # must end with it, not with eos
    tok = real_tokenizer("llama3_1", eos="<|end_of_text|>")
    eot, eom = tok.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    tok.generation_stop_ids = [eot, eom]
    chat = ChatTokens(tok, TOOLS)
    assert chat.stop_ids == [tok.eos_token_id, eot, eom]
    for messages in ends_in_non_assistant(conversation("llama3_1")):
        assert chat.incremental(messages) == chat.whole(messages), len(messages)
    assert tok.eos_token_id not in chat.incremental(conversation("llama3_1"))


def scripted(turns: dict):
    """generate(): for each prompt, the next of the fixed turns of the row whose first prompt it starts with."""
    served = Counter()

    def generate(prompts, max_new_tokens):
        out = []
        for ids in prompts:
            key = next(k for k in turns if tuple(ids[:len(k)]) == k)
            turn = turns[key][served[key]]
            served[key] += 1
            assert len(turn) <= max_new_tokens
            out.append((turn, [-0.25] * len(turn)))
        return out
    return generate


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1"])
def test_a_tool_episode_is_the_whole_conversation(family):
    tok = real_tokenizer(family)
    envs = [CalcEnvironment(tool_format=FORMAT[family]) for _ in range(3)]
    chat = ChatTokens(tok, envs[0].tools.schemas)
    stop = tok.convert_tokens_to_ids(tok.eos_token)
    rows = calc_samples(3, seed=0)
    answers = [str(eval(r["expression"])) for r in rows]  # Python's arithmetic, not the calc tool's
    texts = [(reasoned(family, "I need the tool.", call_text(family, r["expression"])),
              reasoned(family, f"The tool says {a}.", a)) for r, a in zip(rows, answers)]
    turns = {tuple(chat.prompt(env.reset(r))): [tok.encode(t, add_special_tokens=False) + [stop] for t in pair]
             for env, r, pair in zip(envs, rows, texts)}
    trajs = run_episodes(scripted(turns), chat, envs, rows,
                         EpisodeLimits(max_turn_tokens=256, max_context_tokens=4096))
    for t, row, answer, (call, final), sampled in zip(trajs, rows, answers, texts, turns.values()):
        assert (t.end, t.reward, t.turns, t.tool_calls, t.tool_errors) == ("done", 1.0, 2, 1, 0), t
        messages = CalcEnvironment().reset(row) + [
            {"role": "assistant", "content": call},
            {"role": "tool", "name": "calc", "tool_call_id": "call0", "content": answer},
            {"role": "assistant", "content": final}]
        whole = tok.apply_chat_template(messages, tools=chat.tools, tokenize=False)
        assert t.prompt_ids + t.ids + tok.encode(AFTER_LAST_TURN[family], add_special_tokens=False) == \
            tok.encode(whole, add_special_tokens=False)
        asked = tok.apply_chat_template(messages[:-1], tools=chat.tools, tokenize=False, add_generation_prompt=True)
        assert t.prompt_ids + t.ids[:-len(sampled[1])] == tok.encode(asked, add_special_tokens=False)
        # 1 exactly on the scripted ids; the tool's answer is in the template's delta between them
        delta = t.ids[len(sampled[0]):-len(sampled[1])]
        assert t.ids == sampled[0] + delta + sampled[1]
        assert t.model_mask == [1] * len(sampled[0]) + [0] * len(delta) + [1] * len(sampled[1])
        assert t.log_probs == [-0.25] * len(sampled[0]) + [0.0] * len(delta) + [-0.25] * len(sampled[1])
        assert answer in tok.decode(delta)


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1"])
def test_a_bad_tool_call_is_answered_as_a_tool_message(family):
    tok = real_tokenizer(family)
    env = CalcEnvironment(tool_format=FORMAT[family])
    chat = ChatTokens(tok, env.tools.schemas)
    stop = tok.convert_tokens_to_ids(tok.eos_token)
    row = calc_samples(1, seed=1)[0]
    bad = call_text(family, row["expression"]).replace('"calc"', '"calculator"')
    turns = {tuple(chat.prompt(env.reset(row))): [tok.encode(t, add_special_tokens=False) + [stop]
                                                  for t in (bad, row["answer"])]}
    t, = run_episodes(scripted(turns), chat, [env], [row], EpisodeLimits(max_turn_tokens=256, max_context_tokens=4096))
    assert (t.end, t.reward, t.turns, t.tool_calls, t.tool_errors) == ("done", 1.0, 2, 1, 1), t
    messages = CalcEnvironment().reset(row) + [
        {"role": "assistant", "content": bad},
        {"role": "tool", "name": "calculator", "content": "Error: unknown tool 'calculator'; available: calc"}]
    asked = tok.apply_chat_template(messages, tools=chat.tools, tokenize=False, add_generation_prompt=True)
    assert t.prompt_ids + t.ids[:-len(turns[tuple(t.prompt_ids)][1])] == tok.encode(asked, add_special_tokens=False)


def test_qwen3_reasoning_is_neither_a_call_nor_the_answer():
    # what the model writes inside <think> (a call it considers, the number it reads off the tool) is reasoning, as
    # the template splits the turn: only the content after </think> is parsed for calls and scored
    tok = real_tokenizer("qwen3")
    rows = calc_samples(2, seed=2)
    envs = [CalcEnvironment(tool_format="hermes") for _ in rows]
    chat = ChatTokens(tok, envs[0].tools.schemas)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    answers = [str(eval(r["expression"])) for r in rows]
    texts = [(reasoned("qwen3", f"Maybe {call_text('qwen3', '1 + 1')} first? No.", call_text("qwen3", r["expression"])),
              reasoned("qwen3", f"The tool says {a}.", final))
             for r, a, final in zip(rows, answers, ["I cannot tell.", f"It is {answers[1]}."])]
    turns = {tuple(chat.prompt(env.reset(r))): [tok.encode(t, add_special_tokens=False) + [stop] for t in pair]
             for env, r, pair in zip(envs, rows, texts)}
    trajs = run_episodes(scripted(turns), chat, envs, rows, EpisodeLimits(max_turn_tokens=256, max_context_tokens=4096))
    assert [(t.end, t.reward, t.turns, t.tool_calls, t.tool_errors) for t in trajs] == \
        [("done", 0.0, 2, 1, 0), ("done", 1.0, 2, 1, 0)]
    for t, answer in zip(trajs, answers):
        delta = tok.decode([i for i, m in zip(t.ids, t.model_mask) if not m])
        assert delta.count("<tool_response>") == 1 and f"<tool_response>\n{answer}\n</tool_response>" in delta
