"""A tiny word-level tokenizer built in code, so tests and the default job need no downloads. It is WordPiece whose
only sub-word pieces are digit continuations: "42" is ["4", "@@2"] and decodes back to "42" (WordLevel would give
"4 2" and break exact-match rewards); unknown words become <unk>."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)  # ids 0..3, in this order
CONTINUATION = "@@"  # not "##": "####" is a real word in GSM8K answers
DIGITS = [str(d) for d in range(10)]

# "role : content" per message, EOS between messages and after every assistant turn (the token a sampled turn
# ends on, so a multi-turn rollout can append the next messages to it), the assistant turn opened last. Roles and
# ":" are in the default vocabulary.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}"
    "{% if not loop.last or m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% if not loop.last %} {% endif %}"
    "{% endfor %}{% if add_generation_prompt %} assistant :{% endif %}"
)

_SYMBOLS = ["+", "-", "*", "/", "=", "?", ".", ",", ":", "=>", "####", "$", "%", "(", ")", "!"]
_CHAT_WORDS = ["user", "assistant", "system"]
_PARITY_WORDS = ["even", "odd"]
# Every word of verl_ds/tasks/data/gsm8k_mini.jsonl and of gsm8k.INSTRUCTION (a test checks there is no <unk>).
_GSM8K_WORDS = """
A Anna Answer At Ben Each Ella Emma He Her His How It Ivy Jake Ken Kim Leo Lily Lucy Max Mia Monday Noah Nora
Omar Ryan Sam Sara She The Then There They Tom Tuesday Zoe a added adds afternoon after already and animals apples
are as back bag bags baker bakes beads book books bottles bought box boxes bracelet bus buys cakes candies car cars
cartons class classes cookies cost costs cows crayons cut cuts day days did do does dollars drinks each earns eats
eggs equal equally every family farmer father fill final first fish flowers for friend friends garden gave get gets
going got groups had has have he hen hens her his holds home hour hours in into is it juice lay lays left library
liters long loses lot make makes many marbles meters miles minutes more morning movie necklace needed new notebooks
now number of off old on oranges owner pack packs pages pen pencils people picked pie piece pieces pies pizza pizzas
plants pool put puts read reads rest rope row rows run runs save saves school seats sell sells shares she sheep shelf
shelves shirts shop sit slices sold spend spends stickers stop store students tank that the them then there ticket
tickets times to total train travel travels tray trays trip used van vans vase vases walk walks watched water week
weeks wheels with works years
""".split()


def default_vocab() -> list[str]:
    """The built-in vocabulary: digits, symbols, chat roles and every word of the shipped tasks (no specials)."""
    return (DIGITS + [CONTINUATION + d for d in DIGITS] + _SYMBOLS + _CHAT_WORDS + _PARITY_WORDS
            + _GSM8K_WORDS)


def build_tokenizer(vocab: list[str] | None = None, *, pad_is_eos: bool = False,
                    model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The tokenizer over `vocab`: specials at ids 0-3, left padding, no BOS/EOS added on encode."""
    vocab = default_vocab() if vocab is None else vocab
    if isinstance(vocab, str) or not all(isinstance(t, str) and t and not any(c.isspace() for c in t) for t in vocab):
        raise ValueError("vocab: expected a list of non-empty tokens without whitespace, got "
                         f"{vocab!r:.200}")
    words = list(dict.fromkeys([*SPECIAL_TOKENS, *vocab]))  # dedupe, keep order
    model = models.WordPiece({w: i for i, w in enumerate(words)}, unk_token=UNK,
                             continuing_subword_prefix=CONTINUATION)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+ | [^\w\s]+
    backend.decoder = decoders.WordPiece(prefix=CONTINUATION, cleanup=False)
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=EOS if pad_is_eos else PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
        padding_side="left", chat_template=CHAT_TEMPLATE, model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
