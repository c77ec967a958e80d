"""Tokenizers built in code for the multi-turn tests: byte-level BPE with a few merges (so merges across a turn
boundary would show) and chat templates in the ChatML (Qwen2.5-style, with Hermes tool calls) and Llama-3 styles,
written for these tests after the formats' documentation."""
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' }}"
    "{{- (m.content | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# drops the reasoning of every assistant turn but the last, as Qwen3's template does
REWRITING = CHATML.replace(
    "{%- else %}{{- '<|im_start|>' + m.role",
    "{%- elif m.role == 'assistant' and not loop.last %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role")

SPECIALS = {"chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]}


# Llama 3's pre-tokenizer split (its tokenizer.json): a run of newlines is one piece, whatever follows it
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def chat_tokenizer(style: str = "chatml", split: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (256 bytes, merges for common pairs) with ``style``'s specials and template;
    ``split``: "gpt2" (GPT-2's pre-tokenizer, Qwen2's) or "llama3" (the default for the llama3 style)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ċ", "Ċ"), ("i", "n"), ("o", "n"), ("1", "2"), ("Ġ", "1")]:
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    if (split or ("llama3" if style == "llama3" else "gpt2")) == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS["chatml" if style in ("chatml", "rewriting") else style]
    tok.add_special_tokens(specials)
    template = {"chatml": CHATML, "llama3": LLAMA3, "rewriting": REWRITING}[style]
    eos = "<|im_end|>" if style != "llama3" else "<|eot_id|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, eos_token=eos,
                                   pad_token=specials[0])
