"""The built-in agent tokenizer and data: the tiny from-scratch model's vocabulary for ``calc`` and ``guess_number``,
a one-line-per-message chat template that renders tools, and the tasks' rows (docs/agents.md). Text round-trips
exactly (a space glued to the next token, digits and punctuation single, the tasks' words whole, other words
spelled from letters), so a call the model writes decodes to JSON that ``parse_tool_calls`` reads."""
from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["build_agent_tokenizer", "builtin_rows", "AGENT_WORDS", "BUILTIN_TASKS"]

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPACE = "\u2581"  # "▁": a space, glued to the token after it
CONTINUATION = "@@"
# the call markup and the JSON pieces of a Hermes call; matched in the raw text, longest first
CALL_PIECES = ["<tool_call>", "</tool_call>", '{"', '": "', '", "', '": {"', '"}}', '"}', '": ', ', "']

CHAT_TEMPLATE = (
    "{%- if tools %}tools:"
    "{%- for t in tools %} {{ t.function.name }}({{ t.function.parameters.properties | list | join(', ') }})"
    "{%- endfor %}{{ eos_token }}{%- endif %}"
    "{%- for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{%- endif %}")

# Every word the built-in tasks' messages use (verl_ds.agent.tasks), the template's, the tool's schema and the
# errors the calc tool and the call parser send back; anything else is spelled from letters.
AGENT_WORDS = """
system user assistant tool tools calc expression name arguments Use the calc tool for arithmetic then answer with
number only What is I think of a from to Guess it and will say higher or lower Answer Error unknown available
none did you mean must be an object string argument missing raised ValueError TypeError ZeroDivisionError not
arithmetic expression invalid syntax only numbers and parentheses are allowed got too long characters at most
exponent base large call valid JSON Expecting value delimiter property enclosed in double quotes Extra data
Unterminated starting was opened but closed division by zero integer modulo float str int dict list
""".split()

from verl_ds.agent.registry import BUILTIN_AGENT_TASKS as BUILTIN_TASKS  # noqa: E402 (one list of them)
CALC_DIGITS = (2, 3)  # operands of 2-3 digits: beyond a tiny model's head, short enough for it to copy
GUESS_HIGH = 16


def _vocabulary() -> list[str]:
    letters = string.ascii_letters
    symbols = list(string.punctuation)
    words = list(dict.fromkeys(AGENT_WORDS))
    singles = list(string.digits) + symbols + list(letters) + ["\n", "\t"]
    return (singles + [SPACE + c for c in singles] + [SPACE]
            + [CONTINUATION + c for c in letters]
            + [w for w in words if len(w) > 1] + [SPACE + w for w in words if len(w) > 1])


def build_agent_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """The built-in agent tokenizer: <pad> <eos> <bos> <unk> are ids 0-3, <eos> ends every turn, padding on the
    left, the compact chat template above (``tools`` rendered as ``name(arg, ...)``)."""
    vocab = {w: i for i, w in enumerate(dict.fromkeys([PAD, EOS, BOS, UNK, *_vocabulary()]))}
    backend = Tokenizer(models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix=CONTINUATION,
                                         max_input_chars_per_word=64))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    # a word with its leading space, one digit, one other character, or a space before a space
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(f"{SPACE}?[A-Za-z]+|{SPACE}?[^A-Za-z{SPACE}]|{SPACE}"),
                                                 behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(CONTINUATION, ""), decoders.Replace(SPACE, " "),
                                         decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, EOS, BOS, UNK)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in CALL_PIECES])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=BOS,
                                   unk_token=UNK, padding_side="left", chat_template=CHAT_TEMPLATE,
                                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)


def builtin_rows(env_name: str, n: int, seed: int) -> list[dict]:
    """``n`` data set rows of a built-in task, the same for the same (n, seed): each has a ``prompt`` (the
    question, for logs and validation) and the fields the environment's ``reset`` reads."""
    from verl_ds.agent.tasks import calc_samples, guess_samples

    if env_name == "calc":
        return [dict(row, prompt=row["question"]) for row in calc_samples(n, seed, digits=CALC_DIGITS)]
    if env_name == "guess_number":
        return [dict(row, prompt=f"guess a number from 1 to {row['high']}")
                for row in guess_samples(n, seed, GUESS_HIGH)]
    raise ValueError(f"builtin_rows: no built-in data for environment {env_name!r}; built-in: {', '.join(BUILTIN_TASKS)}")

