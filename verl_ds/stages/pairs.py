"""Preference data for the reward-model and DPO jobs: (prompt, chosen, rejected) rows in TRL's formats
(https://huggingface.co/docs/trl/dataset_formats#preference), tokenized, and their batches; docs/stages.md."""
from __future__ import annotations

import torch

from verl_ds.data_files import FILE_REASONS, RowDataset, has_surrogates, is_messages

FIELDS = ("prompt", "chosen", "rejected")
REASONS = {
    **FILE_REASONS,
    "missing_field": "chosen or rejected is missing",
    "non_string_field": "prompt, chosen or rejected is neither a string nor a list of {role, content} messages",
    "mixed_formats": "some of prompt, chosen and rejected are strings and others message lists",
    "invalid_unicode": "a field holds unpaired surrogates",
    "no_chat_template": "messages given but the tokenizer has no chat template",
    "chat_template_error": "the chat template rejected the messages, or cannot be extended turn by turn",
    "completion_not_assistant": "a conversational completion does not start and end with an assistant message",
    "empty_prompt": "the prompt is empty or has no tokens (implicit prompt: chosen and rejected share no prefix)",
    "empty_completion": "chosen or rejected is empty or has no tokens after the prompt",
    "identical": "chosen and rejected are the same (nothing to prefer)",
    "overlong": "prompt longer than max_prompt_length (with overlong='skip') or a completion longer than "
                "max_completion_length (skipped)",
    "truncated": "prompt longer than max_prompt_length (kept, cut from the left)",
}


class PreferenceDataset(RowDataset):
    """Tokenized pairs. Item: {"prompt_ids", "chosen_ids", "rejected_ids": list[int], "prompt": str}; completion ids
    exclude the prompt (the loss positions are theirs)."""

    REASONS = REASONS
    ROWS = "preference rows"
    NOUN, EXPECTED = "preference pairs", f"expected fields {list(FIELDS)}, prompt optional"

    @classmethod
    def _items(cls, rows, tokenizer, bad, *, source: str, max_prompt_length: int | None = None,
               max_completion_length: int | None = None, overlong: str = "truncate"):
        """A longer prompt is cut from the left (or skipped, ``overlong="skip"``); a longer completion skips the pair
        (cut, it is not what was ranked)."""
        chat_tokens = None
        for where, row, reason in rows:
            reason = reason or _check_row(row)
            if reason is None:
                chat = None
                if not isinstance(row["chosen"], str):
                    chat = chat_tokens = chat_tokens or _chat_tokens(tokenizer)
                out = _tokenize(tokenizer, row, chat)
                if isinstance(out, str):
                    reason = out
            if reason is None:
                p_ids, c_ids, r_ids, text = out
                if max_completion_length is not None and max(len(c_ids), len(r_ids)) > max_completion_length:
                    reason = "overlong"
                elif max_prompt_length is not None and len(p_ids) > max_prompt_length:
                    if overlong == "skip":
                        reason = "overlong"
                    else:
                        bad("truncated", where)
                        p_ids = p_ids[-max_prompt_length:]
            if reason is not None:
                bad(reason, where)
                continue
            yield where, row, {"prompt_ids": p_ids, "chosen_ids": c_ids, "rejected_ids": r_ids, "prompt": text}


def _texts(value) -> list[str]:
    return [value] if isinstance(value, str) else [m["content"] for m in value]


def _check_row(row) -> str | None:
    """The reason a row is unusable before tokenizing, or None."""
    if not isinstance(row, dict):
        return "not_an_object"
    if "chosen" not in row or "rejected" not in row:
        return "missing_field"
    values = [row[k] for k in FIELDS if k in row]
    kinds = {"str" if isinstance(v, str) else "messages" if is_messages(v) else None for v in values}
    if None in kinds:
        return "non_string_field"
    if len(kinds) > 1:
        return "mixed_formats"
    if has_surrogates(text for v in values for text in _texts(v)):
        return "invalid_unicode"
    if row["chosen"] == row["rejected"]:
        return "identical"
    return None


def _chat_ids(chat, row) -> tuple[list, list, list, str] | str:
    """(prompt_ids, chosen_ids, rejected_ids, prompt text) of a chat row, or why it fails. A completion is what a model
    emits after the generation prompt (``ChatTokens``), so a reward model learns on the sequences the RL job scores."""
    from verl_ds.agent.chat_tokens import TemplateError

    if isinstance(chat, str):
        return chat
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:
        prompt = row["prompt"]
    else:  # implicit prompt: the messages both conversations start with
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            return "empty_prompt"
        if not chosen or not rejected:
            return "empty_completion"
    if any(c[0]["role"] != "assistant" or c[-1]["role"] != "assistant" for c in (chosen, rejected)):
        return "completion_not_assistant"
    if any(not any(m["content"].strip() for m in c if m["role"] == "assistant") for c in (chosen, rejected)):
        return "empty_completion"
    try:
        p_ids = chat.prompt(prompt)
        done = []
        for completion in (chosen, rejected):
            ids, i = [], 0
            while i < len(completion):
                j = next((k for k in range(i + 1, len(completion)) if completion[k]["role"] == "assistant"),
                         len(completion))
                ids += chat.tokenizer.encode(completion[i]["content"], add_special_tokens=False) + [chat.end_id]
                if j > i + 1:
                    ids += chat.after_turn(completion[i + 1:j])
                i = j
            done.append(ids)
    except (TemplateError, ValueError, TypeError, KeyError):  # templates raise on messages they reject
        return "chat_template_error"
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return p_ids, done[0], done[1], (users[-1] if users else prompt[-1]["content"])


def _tokenize(tokenizer, row, chat):
    """(prompt_ids, chosen_ids, rejected_ids, prompt text) or the reason the row fails; ``chat``: None for a text row,
    else the tokenizer's ChatTokens (or why it has none)."""
    conversational = chat is not None
    eos = tokenizer.eos_token_id
    if chat is not None:
        out = _chat_ids(chat, row)
        if isinstance(out, str):
            return out
        p_ids, c_ids, r_ids, prompt_text = out
    elif "prompt" in row:
        prompt_text = row["prompt"]
        if not prompt_text.strip():
            return "empty_prompt"
        p_ids = tokenizer(prompt_text)["input_ids"]
        c_ids, r_ids = (tokenizer(row[k], add_special_tokens=False)["input_ids"] for k in ("chosen", "rejected"))
    else:  # implicit prompt over tokens
        full_c = tokenizer(row["chosen"])["input_ids"]
        full_r = tokenizer(row["rejected"])["input_ids"]
        n = 0
        while n < min(len(full_c), len(full_r)) and full_c[n] == full_r[n]:
            n += 1
        n = max(0, min(n, len(full_c) - 1, len(full_r) - 1))  # "a b" vs "a b c": each keeps a token of its own
        p_ids, c_ids, r_ids = full_c[:n], full_c[n:], full_r[n:]
        prompt_text = tokenizer.decode(p_ids)
    if not p_ids:
        return "empty_prompt"
    if not conversational and eos is not None:
        c_ids, r_ids = [ids if ids and ids[-1] == eos else ids + [eos] for ids in (c_ids, r_ids)]
    if not c_ids or not r_ids or (not conversational and (len(c_ids) < 2 or len(r_ids) < 2) and eos is not None):
        return "empty_completion"  # an EOS alone is an empty completion
    if c_ids == r_ids:
        return "identical"
    return list(p_ids), list(c_ids), list(r_ids), prompt_text


def _chat_tokens(tokenizer):
    """The tokenizer's ChatTokens, or the reason conversational rows cannot be tokenized."""
    from verl_ds.agent.chat_tokens import ChatTokens, TemplateError

    if not getattr(tokenizer, "chat_template", None):
        return "no_chat_template"
    try:
        return ChatTokens(tokenizer)
    except TemplateError:
        return "chat_template_error"


def collate_pairs(items: list[dict], pad_token_id: int) -> dict:
    """The rollout layout of B pairs, the B chosen rows then the B rejected ones: ``input_ids`` (2B, P + R) int64,
    prompts left-padded to P and completions right-padded to R; ``attention_mask`` (2B, P + R) bool;
    ``response_mask`` (2B, R) bool, the loss positions."""
    if not items:
        raise ValueError("collate_pairs: items is empty")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise ValueError(f"collate_pairs: pad_token_id: expected an int, got {pad_token_id!r}")
    rows = [(it["prompt_ids"], it["chosen_ids"]) for it in items] + [(it["prompt_ids"], it["rejected_ids"])
                                                                   for it in items]
    P, R = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.full((len(rows), P + R), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), P + R), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, P - len(p):P] = torch.as_tensor(p, dtype=torch.int64)
        ids[i, P:P + len(c)] = torch.as_tensor(c, dtype=torch.int64)
        mask[i, P - len(p):P + len(c)] = True
    return {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, P:].clone(), "pairs": len(items)}


def load_pair_data(cfg, job: str):
    """The tokenizer and (train, val) preference sets of the ``job`` ("rm" or "dpo"): ``data.*_files``, or the parity
    task's rule-ranked pairs; limits ``data.max_prompt_length`` and ``<job>.max_completion_length``; ConfigError
    naming the key."""
    from verl_ds.config import ConfigError
    from verl_ds.engines.build import load_tokenizer
    from verl_ds.stages.spine import StageData
    from verl_ds.tasks import parity

    tok = load_tokenizer(cfg)
    d = cfg.data
    limits = dict(max_prompt_length=d.max_prompt_length, overlong=d.overlong,
                  max_completion_length=getattr(cfg, job).max_completion_length)

    def load(key: str, path: str):
        try:
            return PreferenceDataset.from_file(path, tok, **limits)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None

    if d.train_files is None:
        seed = cfg.trainer.seed
        train = PreferenceDataset.from_records(parity.preference_pairs(d.num_train_prompts, seed), tok,
                                               source="parity pairs", **limits)
        val = PreferenceDataset.from_records(parity.preference_pairs(d.num_val_prompts, 10_000 + seed), tok,
                                             source="parity pairs (held out)", **limits)
    else:
        train = load("data.train_files", d.train_files)
        val = load("data.val_files", d.val_files) if d.val_files is not None else None
    if len(train) < cfg.actor.mini_batch_size:
        where = "data.train_files" if d.train_files else "data.num_train_prompts"
        raise ConfigError(f"actor.mini_batch_size={cfg.actor.mini_batch_size} is larger than the {len(train)} usable "
                          f"pairs of {where} ({train.summary()}); a step takes actor.mini_batch_size distinct pairs")
    return StageData(tok, train, val)


def pair_tokens(item: dict) -> int:
    """The tokens a pair's two sequences hold (its share of a token budget)."""
    return 2 * len(item["prompt_ids"]) + len(item["chosen_ids"]) + len(item["rejected_ids"])
