"""Prompt data: load a prompt set (JSON lines, Parquet, a ``datasets`` directory) and left-pad batches for generation.
A bad row never crashes the load: it is skipped (an overlong one truncated, a repeat kept) and counted by reason
(``REASONS``); a missing file or zero usable rows is an error. Details: docs/reliability.md, "Bad input"."""
from __future__ import annotations

import json
import os

import torch

from verl_ds.data_files import read_json_lines, read_parquet, read_saved_dataset

# Why a row was skipped (or, for "truncated" and "duplicate_row", kept and counted), as `report()` counts it.
REASONS = {
    "non_utf8": "line is not valid UTF-8",
    "invalid_json": "line is not valid JSON",
    "huge_number": "an integer has more digits than Python converts (sys.get_int_max_str_digits(), 4300 by default)",
    "duplicate_key": "a JSON object repeats a key (which value was meant is ambiguous)",
    "non_finite_number": "a number is NaN, Infinity or beyond float range (e.g. 1e999); JSON has no such numbers",
    "too_deep": "line is JSON nested too deeply to read",
    "not_an_object": "row is not a JSON object",
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
    "duplicate_row": "the same row as an earlier one in the file (kept: repeats weight a prompt, maybe by mistake)",
}
_OPTIONS = ("prompt_key", "max_prompt_length", "overlong", "empty", "apply_chat_template", "passthrough_keys")
_ITEM_KEYS = ("input_ids", "prompt")  # what every item holds besides pass-through fields
_SHOW = 3  # locations listed per reason in messages
_TOKENIZE_CHUNK = 1024


def read_rows(path: str, split: str | None = None) -> list:
    """``(location, row, reason)`` triples of a .jsonl / .ndjson / .json / .parquet file or a datasets save_to_disk
    directory (``verl_ds.data_files``); ValueError for a missing file or an unsupported extension."""
    if not os.path.exists(path):
        raise ValueError(f"data file {path!r} does not exist")
    if os.path.isdir(path):
        return read_saved_dataset(path, split)
    ext = os.path.splitext(path)[1].lower()
    readers = {".jsonl": read_json_lines, ".ndjson": read_json_lines, ".json": read_json_lines,
               ".parquet": read_parquet}
    if ext not in readers:
        raise ValueError(f"data file {path!r}: unsupported extension {ext!r}; expected one of "
                         f"{sorted(readers)} or a directory saved with datasets' save_to_disk")
    return readers[ext](path)


class PromptDataset(torch.utils.data.Dataset):
    """Tokenized prompts; item i: {"input_ids": list[int], "prompt": str, **pass-through fields}. "prompt" is the text
    reward functions parse: before any chat template or truncation (a chat's last user message)."""

    def __init__(self, items: list[dict], problems: dict[str, list[str]], n_rows: int, source: str,
                 where: list[str] | None = None):
        self.items, self.problems, self.n_rows, self.source = items, problems, n_rows, source
        self.where = list(where) if where is not None else [f"item {i}" for i in range(len(items))]

    @classmethod
    def from_file(cls, path: str, tokenizer, *, split: str | None = None, **options) -> "PromptDataset":
        """Load a file ``read_rows`` reads (``split`` picks from a DatasetDict); ``options`` as ``from_records``."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a file or directory path, got {type(path).__name__}")
        path = os.fspath(path)
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"PromptDataset.from_file: unknown options {unknown}; valid: {list(_OPTIONS)}")
        return _build(cls, read_rows(path, split), tokenizer, source=path, count_duplicates=True, **options)

    @classmethod
    def from_records(cls, records: list, tokenizer, *, prompt_key: str = "prompt",
                     max_prompt_length: int | None = None, overlong: str = "truncate", empty: str = "skip",
                     apply_chat_template: bool = False, passthrough_keys: list[str] | None = None,
                     source: str = "records") -> "PromptDataset":
        """Build from a list of dicts. ``overlong="truncate"`` keeps a prompt's last tokens (its end). With
        ``apply_chat_template`` a prompt may also be a list of {"role", "content"} messages. ``passthrough_keys``: None
        keeps every other field (None where a row lacks it); a list keeps those and skips rows missing one."""
        if isinstance(records, (str, bytes, dict)) or not hasattr(records, "__iter__"):
            raise TypeError(f"records: expected a list of dicts, got {type(records).__name__}")
        rows = [(f"record {i}", row, None) for i, row in enumerate(records)]
        return _build(cls, rows, tokenizer, prompt_key=prompt_key, max_prompt_length=max_prompt_length,
                      overlong=overlong, empty=empty, apply_chat_template=apply_chat_template,
                      passthrough_keys=passthrough_keys, source=source)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def drop(self, indices, reason: str) -> None:
        """Remove the items at ``indices``, counting their rows under ``reason`` (a key of REASONS)."""
        if reason not in REASONS:
            raise ValueError(f"drop: unknown reason {reason!r}; reasons: {sorted(REASONS)}")
        gone = set(indices)
        for i in sorted(gone):
            self.problems.setdefault(reason, []).append(self.where[i])
        self.items = [x for i, x in enumerate(self.items) if i not in gone]
        self.where = [w for i, w in enumerate(self.where) if i not in gone]

    def report(self) -> dict[str, int]:
        """{reason: count} of the rows skipped or truncated; empty when all rows were clean."""
        return {reason: len(where) for reason, where in self.problems.items()}

    def summary(self) -> str:
        """One line: rows read, kept, and each skip/truncate reason with its count and first locations."""
        head = f"{self.source}: kept {len(self.items)} of {self.n_rows} rows"
        if not self.problems:
            return head
        return head + "; " + "; ".join(_describe(reason, where) for reason, where in self.problems.items())


def _describe(reason: str, where: list[str]) -> str:
    more = f", +{len(where) - _SHOW} more" if len(where) > _SHOW else ""
    return f"{reason} {len(where)} ({', '.join(where[:_SHOW])}{more})"


def _check_options(tokenizer, prompt_key, max_prompt_length, overlong, empty, apply_chat_template, passthrough_keys):
    if not isinstance(prompt_key, str) or not prompt_key:
        raise ValueError(f"prompt_key: expected a non-empty field name, got {prompt_key!r}")
    if max_prompt_length is not None and (isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int)
                                          or max_prompt_length < 1):
        raise ValueError(f"max_prompt_length: expected a positive int or None, got {max_prompt_length!r}")
    if overlong not in ("truncate", "skip", "error"):
        raise ValueError(f"overlong: expected 'truncate', 'skip' or 'error', got {overlong!r}")
    if empty not in ("skip", "error"):
        raise ValueError(f"empty: expected 'skip' or 'error', got {empty!r}")
    if passthrough_keys is not None and (isinstance(passthrough_keys, str)
                                         or not all(isinstance(k, str) for k in passthrough_keys)):
        raise ValueError(f"passthrough_keys: expected None or a list of field names, got {passthrough_keys!r}")
    if passthrough_keys is not None and set(passthrough_keys) & set(_ITEM_KEYS):
        raise ValueError(f"passthrough_keys: {sorted(set(passthrough_keys) & set(_ITEM_KEYS))} are reserved for the "
                         "tokenized prompt; rename those fields in the data set")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer: expected a HuggingFace tokenizer, got {type(tokenizer).__name__}")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("apply_chat_template=True but the tokenizer has no chat_template; set "
                         "apply_chat_template=False or use a tokenizer that has one")


def _prompt_text(value, apply_chat_template: bool) -> tuple[str | None, list | None, str | None]:
    """(text, messages, reason) for one prompt field value."""
    if value is None:
        return None, None, "null_prompt"
    if isinstance(value, str):
        return value, None, None
    is_messages = (isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))
    if apply_chat_template and is_messages:
        users = [m["content"] for m in value if m["role"] == "user"]
        return (users[-1] if users else value[-1]["content"]), value, None
    return None, None, "non_string_prompt"


def _row_key(row: dict) -> str:
    """A row's identity for finding repeats: its fields, in any order (Parquet values may not be JSON types)."""
    return json.dumps(row, sort_keys=True, default=repr, ensure_ascii=False)


def _build(cls, rows, tokenizer, *, prompt_key="prompt", max_prompt_length=None, overlong="truncate",
           empty="skip", apply_chat_template=False, passthrough_keys=None, source="records", count_duplicates=False):
    _check_options(tokenizer, prompt_key, max_prompt_length, overlong, empty, apply_chat_template, passthrough_keys)
    problems: dict[str, list[str]] = {}
    kept = []  # (where, prompt text, text to tokenize, passthrough dict, row key or None)

    def bad(reason, where):
        if reason == "empty_prompt" and empty == "error":
            raise ValueError(f"{source}: {where}: empty prompt (empty='error'; use empty='skip' to skip such rows)")
        problems.setdefault(reason, []).append(where)

    if passthrough_keys is None:  # every field but the prompt; the item's own names cannot be overwritten
        keys = list(dict.fromkeys(k for _, row, why in rows if why is None and isinstance(row, dict) for k in row
                                  if k != prompt_key and k not in _ITEM_KEYS))
    else:
        keys = [k for k in passthrough_keys if k != prompt_key]
    for where, row, reason in rows:
        if reason is None and not isinstance(row, dict):
            reason = "not_an_object"
        if reason is None and prompt_key not in row:
            reason = "missing_prompt"
        if reason is not None:
            bad(reason, where)
            continue
        text, messages, reason = _prompt_text(row[prompt_key], apply_chat_template)
        if reason is None and not text.strip():
            reason = "empty_prompt"
        if reason is None:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                reason = "invalid_unicode"
        if reason is None and passthrough_keys is not None and any(k not in row for k in keys):
            reason = "missing_passthrough"
        if reason is not None:
            bad(reason, where)
            continue
        to_tokenize = text
        if apply_chat_template:
            try:
                to_tokenize = tokenizer.apply_chat_template(messages or [{"role": "user", "content": text}],
                                                            tokenize=False, add_generation_prompt=True)
            except Exception:  # templates may raise_exception() on messages they reject (roles not alternating)
                bad("chat_template_error", where)
                continue
        kept.append((where, text, to_tokenize, {k: row.get(k) for k in keys}, _row_key(row) if count_duplicates else None))

    # The chat template already spells out BOS etc. as text; adding special tokens again would double them.
    ids_list = []
    for start in range(0, len(kept), _TOKENIZE_CHUNK):
        chunk = [k[2] for k in kept[start:start + _TOKENIZE_CHUNK]]
        ids_list += tokenizer(chunk, add_special_tokens=not apply_chat_template)["input_ids"]

    items, item_where, first_seen = [], [], {}
    for (where, text, _, extras, key), ids in zip(kept, ids_list):
        if not ids:
            bad("empty_prompt", where)
            continue
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if overlong == "error":
                raise ValueError(f"{source}: {where}: prompt has {len(ids)} tokens > max_prompt_length="
                                 f"{max_prompt_length} (overlong='error'; use 'truncate' or 'skip')")
            bad("overlong" if overlong == "skip" else "truncated", where)
            if overlong == "skip":
                continue
            ids = ids[-max_prompt_length:]
        if key is not None:  # generated sets (from_records) repeat short prompts by design: files only
            if key in first_seen:
                bad("duplicate_row", f"{where}={first_seen[key]}")
            else:
                first_seen[key] = where
        items.append({"input_ids": list(ids), "prompt": text, **extras})
        item_where.append(where)

    dataset = cls(items, problems, len(rows), source, where=item_where)
    if not items:
        fields = next((sorted(row) for _, row, _ in rows if isinstance(row, dict)), [])
        raise ValueError(f"{source}: no usable prompts (prompt_key={prompt_key!r}; fields of the first row: {fields}). "
                         f"{dataset.summary()}")
    return dataset


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
