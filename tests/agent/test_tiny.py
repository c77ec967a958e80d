"""verl_ds.agent.tiny and verl_ds.agent.warmup: the built-in agent tokenizer round-trips what the model writes
(tool calls parse), has every word the built-in tasks and their tool messages use, extends turn by turn as it
renders whole; the built-in rows are deterministic and carry what the environments read; the cold start teaches
a tiny model from scratch to write calls while it rarely decides to."""
import json
import random
import string

import pytest
import torch

from verl_ds.agent import make_environment, parse_tool_calls
from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.tiny import build_agent_tokenizer, builtin_rows
from verl_ds.agent.warmup import CALL_FRACTION, demonstration, demonstration_tokens, demonstrations
from verl_ds.sft_loss import warm_up

TOK = build_agent_tokenizer()
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "47 * 83"}}</tool_call>'


def chat_for(env_name):
    tools = make_environment(env_name).tools
    return ChatTokens(TOK, tools.schemas if tools else None)


def test_a_tool_call_round_trips_and_parses():
    ids = TOK.encode(CALL, add_special_tokens=False)
    assert TOK.decode(ids) == CALL
    parsed = parse_tool_calls(TOK.decode(ids), "hermes")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calc", {"expression": "47 * 83"})]
    assert not parsed.errors
    # the markup and the JSON pieces are single tokens: a call is short enough for the tiny model's context
    assert len(ids) == 17
    # a number keeps its digits together, whatever precedes it
    for text in ["1378758", "assistant says 12 and 34", " 7"]:
        assert TOK.decode(TOK.encode(text, add_special_tokens=False)) == text


def test_printable_ascii_round_trips_without_unk():
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = TOK.encode(text, add_special_tokens=False)
        assert TOK.unk_token_id not in ids, text
        assert TOK.decode(ids) == text, text


BAD_TURNS = [
    '<tool_call>{"name": "calc", "arguments": {"expression": "1 / 0"}}</tool_call>',
    '<tool_call>{"name": "calx", "arguments": {"expression": "1 + 2"}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"expression": 12}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"expression": "2 ** 100"}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"expression": "abc + 1"}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"expression": "3 *"}}</tool_call>',
    '<tool_call>not json</tool_call>', '<tool_call>{"name": "calc"', '<tool_call>[1, 2]</tool_call>',
    "hello", "",
]


def conversations():
    """Demonstrations of both tasks, and calc / guess_number episodes whose turns are every kind of bad call."""
    rng = random.Random(1)
    for env_name in ("calc", "guess_number"):
        for row in builtin_rows(env_name, 60, seed=3):
            yield env_name, demonstration(env_name, row, rng)
        for row, bad in zip(builtin_rows(env_name, len(BAD_TURNS), seed=4), BAD_TURNS):
            env = make_environment(env_name)
            messages = env.reset(row)
            for turn in (bad, bad, row.get("answer", "8")):
                messages.append({"role": "assistant", "content": turn})
                step = env.step(turn)
                messages += step.messages
                if step.done:
                    break
            yield env_name, messages


def test_every_rendered_episode_is_in_the_vocabulary_and_extends_turn_by_turn():
    seen_errors = set()
    for env_name, messages in conversations():
        chat = chat_for(env_name)
        text = TOK.apply_chat_template(messages, tools=chat.tools, tokenize=False)
        ids = TOK.encode(text, add_special_tokens=False)
        assert TOK.unk_token_id not in ids, text
        assert TOK.decode(ids) == text
        seen_errors |= {m["content"].split(":")[0] for m in messages if m["content"].startswith("Error")}
        for end in range(1, len(messages) + 1):
            part = messages[:end]
            if part[-1]["role"] != "assistant" and any(m["role"] == "assistant" for m in part):
                assert chat.incremental(part) == chat.whole(part), part
    assert seen_errors == {"Error"}  # the bad turns did reach the model as tool errors


def test_the_template_is_compact_and_ends_turns_with_eos():
    chat = chat_for("calc")
    messages = make_environment("calc").reset(builtin_rows("calc", 1, seed=0)[0])
    text = TOK.apply_chat_template(messages, tools=chat.tools, tokenize=False, add_generation_prompt=True)
    assert text == ("tools: calc(expression)<eos>system:Use the calc tool for arithmetic, then answer with the number "
                    f"only.<eos>user:{messages[1]['content']}<eos>assistant:")
    assert chat.stop_ids == [TOK.eos_token_id]
    assert len(chat.prompt(messages)) < 48


@pytest.mark.parametrize("env_name", ["calc", "guess_number"])
def test_builtin_rows_are_deterministic_and_carry_the_reset_fields(env_name):
    rows = builtin_rows(env_name, 50, seed=7)
    assert rows == builtin_rows(env_name, 50, seed=7)
    assert rows != builtin_rows(env_name, 50, seed=8)
    assert rows[:10] == builtin_rows(env_name, 10, seed=7)
    for row in rows:
        assert isinstance(row["prompt"], str) and row["prompt"]
        make_environment(env_name).reset(row)
        json.dumps(row)  # a data set row: plain JSON values
        if env_name == "calc":
            a, op, b = row["expression"].split()
            assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert row["prompt"] == row["question"] == f"What is {row['expression']}?"
        else:
            assert 1 <= row["secret"] <= row["high"]


def test_builtin_rows_name_the_known_tasks():
    with pytest.raises(ValueError, match="'calc', 'guess_number'|calc, guess_number"):
        builtin_rows("chess", 4, seed=0)


def test_demonstration_tokens_label_the_assistant_turns_only():
    chat = chat_for("calc")
    row = builtin_rows("calc", 1, seed=0)[0]
    call = f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{row["expression"]}"}}}}</tool_call>'
    messages = make_environment("calc").reset(row) + [
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "calc", "tool_call_id": "call0", "content": row["answer"]},
        {"role": "assistant", "content": row["answer"]}]
    ids, mask = demonstration_tokens(chat, messages)
    labelled = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert labelled == call + "<eos>" + row["answer"] + "<eos>"
    assert TOK.decode(ids) == TOK.apply_chat_template(messages, tools=chat.tools, tokenize=False)
    _, unlabelled = demonstration_tokens(chat, messages, decision=False)
    assert sum(mask) - sum(unlabelled) == 1 and unlabelled[mask.index(1)] == 0


class PlainEngine(torch.nn.Module):
    """The engine contract of warm_up over a plain model and AdamW (no DeepSpeed needed for the contract)."""

    def __init__(self, model, lr):
        super().__init__()
        self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=lr)
        self.device = torch.device("cpu")

    def forward(self, **kw):
        return self.model(**kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(TOK), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, pad_token_id=TOK.pad_token_id,
                                        eos_token_id=TOK.eos_token_id, bos_token_id=TOK.bos_token_id))


@pytest.fixture
def one_thread():
    """A model this small trains faster on one thread: a second thread's hand-offs cost more than it shares, most of
    all when another process holds the second core (the background vLLM runs of make test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_cold_start_teaches_the_call_but_not_to_call(one_thread):
    model = tiny_llama()
    chat = chat_for("calc")
    rows = builtin_rows("calc", 64, seed=99)
    prompts = [chat.prompt(make_environment("calc").reset(r)) for r in rows]
    call_id = TOK.convert_tokens_to_ids("<tool_call>")

    def same_length(some):  # prompts of one length batch without padding: the rows' own computations, batched
        lengths = sorted({len(p) for p in some})
        return [[p for p in some if len(p) == n] for n in lengths]

    def decision_rate():  # mean P(<tool_call>) as the first token of the first turn
        with torch.no_grad():
            return sum(torch.softmax(model(torch.tensor(batch)).logits[:, -1], -1)[:, call_id].sum().item()
                       for batch in same_length(prompts)) / len(prompts)

    engine = PlainEngine(model, lr=1e-5)
    losses = warm_up(engine, demonstrations("calc", TOK, 150 * 16, seed=0), TOK.pad_token_id, lr=3e-3)
    assert len(losses) == 150
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 / 3, losses
    # the decision is supervised at CALL_FRACTION (2%) though most demonstrations call: the warmed model seldom
    # calls (labelling every decision would teach it to call in most episodes) ...
    assert decision_rate() < 2 * CALL_FRACTION
    # ... but once it has opened a call, it writes a well-formed one to calc
    model.eval()
    well = 0
    for batch in same_length(prompts[:16]):
        out = model.generate(torch.tensor([p + [call_id] for p in batch]), max_new_tokens=24, do_sample=False,
                             eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
        for row in out[:, len(batch[0]):]:  # from the opened call on; a row that ended early is padded after EOS
            parsed = parse_tool_calls(TOK.decode(row, skip_special_tokens=True))
            well += len(parsed.calls) == 1 and not parsed.errors and parsed.calls[0].name == "calc"
    assert well >= 12


def test_there_are_no_demonstrations_for_an_unknown_task():
    with pytest.raises(ValueError, match="no built-in data for environment 'chess'.*calc, guess_number"):
        demonstrations("chess", TOK, 16, seed=0)
