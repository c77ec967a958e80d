"""Prompt data: the prompt set, tokenized, and its left-padded batches for generation. A bad row is skipped and
counted by reason (``REASONS``), never a crash; docs/reliability.md, "Bad input"."""
from __future__ import annotations

import json
import os

import torch

from verl_ds.data_files import FILE_REASONS, RowDataset, has_surrogates, is_messages

REASONS = {
    **FILE_REASONS,
    "missing_prompt": "prompt field missing",
    "null_prompt": "prompt is null",
    "non_string_prompt": "prompt is not a string (or a chat message list with apply_chat_template)",
    "invalid_unicode": "prompt holds unpaired surrogates",
    "empty_prompt": "prompt is empty, whitespace only, or has no tokens",
    "chat_template_error": "the tokenizer's chat template rejected the messages",
    "missing_passthrough": "a field named in passthrough_keys is missing",
    "overlong": "prompt longer than max_prompt_length (skipped)",
    "truncated": "prompt longer than max_prompt_length (kept, cut from the left)",
    "unscorable": "a reward function raised an error on the row (checked with an empty response before training)",
}
_ITEM_KEYS = ("input_ids", "prompt")  # what every item holds besides pass-through fields
_TOKENIZE_CHUNK = 1024


class PromptDataset(RowDataset):
    """Tokenized prompts; item i: {"input_ids": list[int], "prompt": str, **pass-through fields}. "prompt" is the text
    reward functions parse: before any chat template or truncation (a chat's last user message)."""

    REASONS = REASONS
    OVERLONG = ("truncate", "skip", "error")
    NOUN, EXPECTED = "prompts", "prompt_key={prompt_key!r}"

    @classmethod
    def _items(cls, rows, tokenizer, bad, *, source: str, prompt_key: str = "prompt",
               max_prompt_length: int | None = None, overlong: str = "truncate", empty: str = "skip",
               apply_chat_template: bool = False, passthrough_keys: list[str] | None = None):
        """``overlong="truncate"`` keeps a prompt's last tokens (its end). With ``apply_chat_template`` a prompt may
        also be a list of {"role", "content"} messages. ``passthrough_keys``: None keeps every other field (None where
        a row lacks it); a list keeps those and skips rows missing one."""
        _check_options(tokenizer, prompt_key, empty, apply_chat_template, passthrough_keys)

        def skip(reason, where):
            if reason == "empty_prompt" and empty == "error":
                raise ValueError(f"{source}: {where}: empty prompt (empty='error'; use empty='skip' to skip such rows)")
            bad(reason, where)

        if passthrough_keys is None:  # every field but the prompt; the item's own names cannot be overwritten
            keys = list(dict.fromkeys(k for _, row, why in rows if why is None and isinstance(row, dict) for k in row
                                      if k != prompt_key and k not in _ITEM_KEYS))
        else:
            keys = [k for k in passthrough_keys if k != prompt_key]
        kept = []  # (where, row, prompt text, text to tokenize)
        for where, row, reason in rows:
            if reason is None and not isinstance(row, dict):
                reason = "not_an_object"
            if reason is None and prompt_key not in row:
                reason = "missing_prompt"
            if reason is None:
                text, messages, reason = _prompt_text(row[prompt_key], apply_chat_template)
            if reason is None and not text.strip():
                reason = "empty_prompt"
            if reason is None and has_surrogates([text]):
                reason = "invalid_unicode"
            if reason is None and passthrough_keys is not None and any(k not in row for k in keys):
                reason = "missing_passthrough"
            if reason is not None:
                skip(reason, where)
                continue
            to_tokenize = text
            if apply_chat_template:
                try:
                    to_tokenize = tokenizer.apply_chat_template(messages or [{"role": "user", "content": text}],
                                                                tokenize=False, add_generation_prompt=True)
                except Exception:  # templates may raise_exception() on messages they reject (roles not alternating)
                    skip("chat_template_error", where)
                    continue
            kept.append((where, row, text, to_tokenize))

        # The chat template already spells out BOS etc. as text; adding special tokens again would double them.
        ids_list = []
        for start in range(0, len(kept), _TOKENIZE_CHUNK):
            chunk = [k[3] for k in kept[start:start + _TOKENIZE_CHUNK]]
            ids_list += tokenizer(chunk, add_special_tokens=not apply_chat_template)["input_ids"]
        for (where, row, text, _), ids in zip(kept, ids_list):
            if not ids:
                skip("empty_prompt", where)
                continue
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                if overlong == "error":
                    raise ValueError(f"{source}: {where}: prompt has {len(ids)} tokens > max_prompt_length="
                                     f"{max_prompt_length} (overlong='error'; use 'truncate' or 'skip')")
                bad("overlong" if overlong == "skip" else "truncated", where)
                if overlong == "skip":
                    continue
                ids = ids[-max_prompt_length:]
            yield where, row, {"input_ids": list(ids), "prompt": text, **{k: row.get(k) for k in keys}}


def _check_options(tokenizer, prompt_key, empty, apply_chat_template, passthrough_keys):
    if not isinstance(prompt_key, str) or not prompt_key:
        raise ValueError(f"prompt_key: expected a non-empty field name, got {prompt_key!r}")
    if empty not in ("skip", "error"):
        raise ValueError(f"empty: expected 'skip' or 'error', got {empty!r}")
    if passthrough_keys is not None and (isinstance(passthrough_keys, str)
                                         or not all(isinstance(k, str) for k in passthrough_keys)):
        raise ValueError(f"passthrough_keys: expected None or a list of field names, got {passthrough_keys!r}")
    if passthrough_keys is not None and set(passthrough_keys) & set(_ITEM_KEYS):
        raise ValueError(f"passthrough_keys: {sorted(set(passthrough_keys) & set(_ITEM_KEYS))} are reserved for the "
                         "tokenized prompt; rename those fields in the data set")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("apply_chat_template=True but the tokenizer has no chat_template; set "
                         "apply_chat_template=False or use a tokenizer that has one")


def _prompt_text(value, apply_chat_template: bool) -> tuple[str | None, list | None, str | None]:
    """(text, messages, reason) for one prompt field value."""
    if value is None:
        return None, None, "null_prompt"
    if isinstance(value, str):
        return value, None, None
    if apply_chat_template and is_messages(value):
        users = [m["content"] for m in value if m["role"] == "user"]
        return (users[-1] if users else value[-1]["content"]), value, None
    return None, None, "non_string_prompt"


def collate_prompts(items: list[dict], pad_token_id: int, device=None) -> dict:
    """Left-pad items to the longest prompt: input_ids (B, P) int64, attention_mask (B, P) bool, prompt_length (B,)
    int64, prompts list[str], extras {field: list} (None where an item lacks it); tensors on ``device``."""
    if not items:
        raise ValueError("collate_prompts: items is empty")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise ValueError(f"collate_prompts: pad_token_id: expected an int, got {pad_token_id!r} "
                         "(a tokenizer without a pad token: set tokenizer.pad_token = tokenizer.eos_token)")
    lengths = [len(item["input_ids"]) for item in items]
    if min(lengths) == 0:
        raise ValueError(f"collate_prompts: item {lengths.index(0)} has no input_ids")
    B, P = len(items), max(lengths)
    input_ids = torch.full((B, P), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((B, P), dtype=torch.bool)
    for i, item in enumerate(items):
        n = lengths[i]
        input_ids[i, P - n:] = torch.as_tensor(item["input_ids"], dtype=torch.int64)
        attention_mask[i, P - n:] = True
    keys = dict.fromkeys(k for item in items for k in item if k not in _ITEM_KEYS)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "prompt_length": torch.tensor(lengths, dtype=torch.int64, device=device),
            "prompts": [item["prompt"] for item in items], "extras": {k: [item.get(k) for item in items] for k in keys}}


def write_data_report(run_dir: str, datasets: dict) -> str:
    """``<run>/data_report.json``: rows read, kept, and skipped/truncated counts by reason, per data set."""
    report = {name: {"source": ds.source, "rows": ds.n_rows, "kept": len(ds), "problems": ds.report(),
                     "summary": ds.summary()} for name, ds in datasets.items() if ds is not None}
    path = os.path.join(run_dir, "data_report.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    return path
