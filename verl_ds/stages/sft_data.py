"""SFT rows in TRL's formats (https://huggingface.co/docs/trl/dataset_formats), tokenized with the loss on each
assistant turn's content and end-of-turn token only: what a rollout samples. Formats and limits: docs/stages.md."""
from __future__ import annotations

from verl_ds.data_files import FILE_REASONS, RowDataset, has_surrogates, is_messages

REASONS = {
    **FILE_REASONS,
    "invalid_unicode": "prompt or completion holds unpaired surrogates",
    "chat_template_error": "the tokenizer's chat template rejected the messages",
    "missing_fields": "row has neither 'messages' nor the prompt field and 'completion'",
    "bad_messages": "messages are not a non-empty list of {role: str, content: str}",
    "bad_fields": "prompt and completion are not both strings or both message lists",
    "no_assistant_turn": "no assistant turn to train on",
    "empty_prompt": "prompt is empty or has no tokens",
    "empty_completion": "completion is empty or has no tokens",
    "no_chat_template": "chat messages but the tokenizer has no chat template",
    "overlong": "prompt longer than data.max_prompt_length or completion longer than sft.max_completion_length "
                "(skipped)",
    "truncated": "prompt longer than data.max_prompt_length (cut from the left) or completion longer than "
                 "sft.max_completion_length (cut from the right); kept",
}


class SFTDataset(RowDataset):
    """Tokenized SFT rows. Item: {"prompt_ids", "response_ids", "loss_mask"} (lists; loss_mask over the response)."""

    REASONS = REASONS
    NOUN, EXPECTED = "SFT rows", "expected 'messages', or {prompt_key!r} and 'completion'"

    @classmethod
    def _items(cls, rows, tokenizer, bad, *, source: str, prompt_key: str = "prompt",
               max_prompt_length: int | None = None, max_completion_length: int | None = None,
               overlong: str = "truncate", apply_chat_template: bool = False):
        """A longer prompt is cut from the left, a longer completion from the right (or the row skipped,
        ``overlong="skip"``)."""
        for where, row, reason in rows:
            if reason is None:
                ids, mask, reason = row_tokens(row, tokenizer, prompt_key, apply_chat_template)
            if reason is None and 1 not in mask:
                reason = "empty_completion"
            if reason is None:
                start = mask.index(1)
                end = len(mask) - mask[::-1].index(1)  # tokens after the last trained one predict nothing we train
                prompt, response, loss_mask = ids[:start], ids[start:end], mask[start:end]
                if not prompt:
                    reason = "empty_prompt"  # the first trained token needs a token to be predicted from
            if reason is not None:
                bad(reason, where)
                continue
            long_prompt = max_prompt_length is not None and len(prompt) > max_prompt_length
            long_response = max_completion_length is not None and len(response) > max_completion_length
            if long_prompt or long_response:
                bad("overlong" if overlong == "skip" else "truncated", where)
                if overlong == "skip":
                    continue
                if long_prompt:
                    prompt = prompt[-max_prompt_length:]
                if long_response:
                    response, loss_mask = response[:max_completion_length], loss_mask[:max_completion_length]
            yield where, row, {"prompt_ids": prompt, "response_ids": response, "loss_mask": loss_mask}


def _encode(tok, text: str, specials: bool) -> list:
    return list(tok(text, add_special_tokens=specials)["input_ids"])


def _render(tok, messages: list, generation_prompt: bool) -> list:
    # the template spells out BOS and the like as text: no special tokens added again
    return _encode(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt),
                   False)


def _find(seq: list, part: list, start: int) -> int:
    for i in range(start, len(seq) - len(part) + 1):
        if seq[i:i + len(part)] == part:
            return i
    return -1


def _turn_start(tok, messages: list, i: int, upto: list) -> int:
    """Where assistant turn ``i``'s own tokens start in ``upto`` (the rendering up to and including it): after the
    generation prompt, also where a template closes the previous turn otherwise when it is the last; -1 if not found."""
    if i == 0:
        return 0
    before_gen, before = _render(tok, messages[:i], True), _render(tok, messages[:i], False)
    if upto[:len(before_gen)] == before_gen:
        return len(before_gen)
    if upto[:len(before)] != before or before_gen[:len(before)] != before:
        return -1
    header = before_gen[len(before):]
    at = _find(upto, header, len(before)) if header else len(before)
    return -1 if at < 0 else at + len(header)


def _turn_end(upto: list, start: int, stops: set) -> int:
    """Just after the last stop token of the turn ``upto[start:]`` (sampling ends there), else its end."""
    return next((k + 1 for k in range(len(upto) - 1, start - 1, -1) if upto[k] in stops), len(upto))


def chat_tokens(tok, messages: list, first_trained: int = 0) -> tuple:
    """(ids, mask, reason): the conversation's ids, a mask of its assistant turns from index ``first_trained`` on
    (content and end-of-turn token only), and None or a key of REASONS."""
    if not getattr(tok, "chat_template", None):
        return None, None, "no_chat_template"
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    if not trained:
        return None, None, "no_assistant_turn"
    eos = tok.eos_token_id
    stops = {*(eos if isinstance(eos, list) else [eos]), *(getattr(tok, "generation_stop_ids", None) or [])}
    try:
        ids = _render(tok, messages, False)
        mask = [0] * len(ids)
        for i in trained:
            upto = _render(tok, messages[:i + 1], False)
            start = _turn_start(tok, messages, i, upto)
            if start < 0 or ids[:len(upto)] != upto or start >= len(upto):
                return None, None, "chat_template_error"
            end = _turn_end(upto, start, stops)
            mask[start:end] = [1] * (end - start)
    except Exception:  # templates may raise_exception() on messages they reject (roles not alternating)
        return None, None, "chat_template_error"
    return ids, mask, None


def _text_tokens(tok, prompt: str, completion: str) -> tuple:
    prompt_ids, completion_ids = _encode(tok, prompt, True), _encode(tok, completion, False)
    if completion_ids and completion_ids[-1] != tok.eos_token_id:
        completion_ids.append(tok.eos_token_id)  # the model learns to stop (TRL appends EOS too)
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids), prompt_ids, completion_ids


def row_tokens(row, tok, prompt_key: str, apply_chat_template: bool) -> tuple:
    """(ids, mask, reason) of one row (formats: docs/stages.md, "SFT data")."""
    if not isinstance(row, dict):
        return None, None, "not_an_object"
    if "messages" in row:
        if not is_messages(row["messages"]):
            return None, None, "bad_messages"
        return chat_tokens(tok, row["messages"])
    if prompt_key not in row or "completion" not in row:
        return None, None, "missing_fields"
    prompt, completion = row[prompt_key], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if has_surrogates((prompt, completion)):
            return None, None, "invalid_unicode"
        if not prompt.strip():
            return None, None, "empty_prompt"
        if not completion.strip():
            return None, None, "empty_completion"
        if apply_chat_template:
            return chat_tokens(tok, [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}])
        ids, mask, prompt_ids, completion_ids = _text_tokens(tok, prompt, completion)
        if not prompt_ids:
            return None, None, "empty_prompt"
        return (ids, mask, None) if completion_ids else (None, None, "empty_completion")
    if is_messages(prompt) and is_messages(completion):
        return chat_tokens(tok, prompt + completion, first_trained=len(prompt))
    return None, None, "bad_fields"
