"""verl_ds.agent.chat_tokens: a conversation built turn by turn (model turns as sampled ids, the environment's
messages as template deltas) equals apply_chat_template over the whole conversation where the template allows it;
a template that rewrites earlier turns is reported."""
import pytest

from chat_testutil import chat_tokenizer
from verl_ds.agent.chat_tokens import ChatTokens, TemplateError
from verl_ds.agent.tools import ToolSet, calc

CONVERSATION = [
    {"role": "system", "content": "Use the calc tool."},
    {"role": "user", "content": "What is 12 * 12?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {"expression": "12 * 12"}}</tool_call>'},
    {"role": "tool", "content": "144"},
    {"role": "assistant", "content": "Let me check again."},
    {"role": "user", "content": "Sure, the answer?"},
    {"role": "tool", "content": "the end"},
]


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_incremental_equals_whole(style, with_tools):
    tok = chat_tokenizer(style)
    chat = ChatTokens(tok, ToolSet([calc]).schemas if with_tools else None)
    for end in range(4, len(CONVERSATION) + 1):
        msgs = CONVERSATION[:end]
        if msgs[-1]["role"] == "assistant":
            continue
        whole = tok.apply_chat_template(msgs, tools=chat.tools, tokenize=False, add_generation_prompt=True)
        assert chat.incremental(msgs) == tok.encode(whole, add_special_tokens=False), (style, end)
        assert not chat.rewrites_history(msgs)


def test_the_delta_is_only_the_new_messages():
    tok = chat_tokenizer("chatml")
    chat = ChatTokens(tok)
    delta = chat.after_turn([{"role": "tool", "content": "144"}])
    # hand-written: the newline Qwen's template puts after <|im_end|>, the tool turn, the assistant header
    assert tok.decode(delta) == "\n<|im_start|>user\n<tool_response>\n144\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert chat.stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert chat.ended(tok.encode("144") + chat.stop_ids) and not chat.ended(tok.encode("144"))


def test_a_template_that_rewrites_history_is_reported():
    tok = chat_tokenizer("rewriting")
    chat = ChatTokens(tok)
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>hmm</think>A"},
            {"role": "user", "content": "Q2"}]
    assert chat.rewrites_history(msgs)
    # the ids built turn by turn keep the reasoning the model sampled
    assert "<think>hmm</think>A" in tok.decode(chat.incremental(msgs))


def test_a_merge_across_the_turn_boundary_is_reported():
    # GPT-2's split with Llama 3's header: the prompt's trailing "\n\n" is one token when the model starts its turn,
    # two once the turn's text follows it in a re-encoded conversation: re-tokenising would change the ids
    tok = chat_tokenizer("llama3", split="gpt2")
    chat = ChatTokens(tok)
    msgs = CONVERSATION[:4]
    assert chat.rewrites_history(msgs)
    prompt = chat.prompt(msgs[:2])
    assert chat.incremental(msgs)[:len(prompt)] == prompt  # the ids the model was given stay its ids


def test_a_template_that_renders_an_assistant_turn_differently_once_messages_follow_extends_and_is_reported():
    # an assistant turn rendered one way while it is the last message and another way once a message follows it
    # (Qwen3 writes an empty <think> block into the last assistant turn only): the ids after the turn are still the
    # template's, the rewrite shows in rewrites_history
    tok = chat_tokenizer("chatml")
    tok.chat_template = tok.chat_template.replace(
        "{%- else %}{{- '<|im_start|>' + m.role",
        "{%- elif m.role == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n[old]' + m.content + "
        "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m.role")
    chat = ChatTokens(tok)
    delta = chat.after_turn([{"role": "tool", "content": "144"}])
    assert tok.decode(delta) == "\n<|im_start|>user\n<tool_response>\n144\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert chat.rewrites_history(CONVERSATION[:4])


def test_a_template_that_no_longer_ends_the_turn_with_its_stop_token_once_messages_follow_is_refused():
    # the model's turn ends on <|im_end|>; a template that closes it otherwise in history leaves nothing to append to
    tok = chat_tokenizer("chatml")
    tok.chat_template = tok.chat_template.replace(
        "{%- else %}{{- '<|im_start|>' + m.role",
        "{%- elif m.role == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n' + m.content + "
        "'[END]\\n' }}{%- else %}{{- '<|im_start|>' + m.role")
    chat = ChatTokens(tok)
    with pytest.raises(TemplateError, match="no longer ends an assistant turn with '<\\|im_end\\|>' once messages"):
        chat.after_turn([{"role": "tool", "content": "144"}])


def test_templates_that_cannot_be_extended_are_refused():
    tok = chat_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(TemplateError, match="has no chat_template"):
        ChatTokens(tok)
    tok = chat_tokenizer("chatml")
    tok.chat_template = tok.chat_template.replace("m.content + '<|im_end|>", "m.content + '[END]")
    with pytest.raises(TemplateError, match="starts with none of the stop tokens"):
        ChatTokens(tok)


# --- a real checkpoint's byte-level tokenizer and template (SmolLM2-135M-Instruct, ChatML) ----------------------

REAL_CONVERSATION = [
    {"role": "user", "content": "What is 4821 * 37? Use the tool."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calc", "arguments": {"expression": "4821 * 37"}}\n'
                                     '</tool_call>'},
    {"role": "tool", "content": "178377"},
    {"role": "assistant", "content": "Let me check again:  4821*37\n\n"},
    {"role": "tool", "content": "  178377\n"},
    {"role": "user", "content": "So? 😊 café"},
    {"role": "assistant", "content": "178377"},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def smollm2():
    from real_templates import smollm2_tokenizer

    return smollm2_tokenizer()


def test_incremental_equals_apply_chat_template_with_a_real_tokenizer(smollm2):
    chat = ChatTokens(smollm2)
    assert chat.end_id == smollm2.convert_tokens_to_ids("<|im_end|>") == smollm2.eos_token_id
    for end in range(2, len(REAL_CONVERSATION) + 1):
        msgs = REAL_CONVERSATION[:end]
        if msgs[-1]["role"] == "assistant":
            continue
        whole = smollm2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert chat.incremental(msgs) == list(whole["input_ids"]), end
        assert not chat.rewrites_history(msgs)


def test_warmup_mask_is_trls_generation_tagged_mask_with_a_real_tokenizer(smollm2):
    # the agent warm-up trains what a rollout samples: each assistant turn's content and <|im_end|>, not the
    # template's newline after it nor the environment's messages
    from real_templates import generation_tagged_mask
    from verl_ds.agent.warmup import demonstration_tokens

    conversation = REAL_CONVERSATION[:-1]  # a demonstration ends with the model's last turn
    ids, mask = demonstration_tokens(ChatTokens(smollm2), conversation)
    trl_ids, trl_mask = generation_tagged_mask(smollm2, conversation)
    n = len(ids)
    assert ids == trl_ids[:n] and mask == trl_mask[:n]
    assert smollm2.decode(trl_ids[n:]) == "\n" and not any(trl_mask[n:])  # the template's closing newline
