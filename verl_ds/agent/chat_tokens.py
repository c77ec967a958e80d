"""Token in / token out: a trajectory grows by the model's tokens as sampled and by the chat template's delta for the
messages after them, never by re-encoding the conversation, which would score ids the sampler never produced
(verl issues #6501 and #3960, TRL PR #5242). A template that rewrites history (Qwen3) is reported
(``rewrites_history``) and trained on the sampled ids; docs/agents.md, "Token in / token out"."""
from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["ChatTokens", "TemplateError", "generation_stop_ids"]

log = logging.getLogger(__name__)

_BASE = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]


class TemplateError(ValueError):
    """A chat template that cannot be extended turn by turn (it rewrites what it rendered before)."""


class ChatTokens:
    """A conversation's token pieces under a tokenizer's chat template and ``tools``. ``stop_ids``: eos, then
    ``tokenizer.generation_stop_ids``; ``end_id``: the one the template closes an assistant turn with."""

    def __init__(self, tokenizer: Any, tools: list | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(f"{type(tokenizer).__name__} has no chat_template: multi-turn rollouts render the "
                                f"environment's messages with it (set tokenizer.chat_template)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.stop_ids = self._stop_ids()
        base = self._render(_BASE)
        end = base.rindex(_BASE[-1]["content"]) + len(_BASE[-1]["content"])
        closing = base[end:]  # what follows the assistant's content: its end-of-turn token, then perhaps more
        marker = next((t for t in self._stop_texts() if closing.startswith(t)), None)
        if marker is None:
            raise TemplateError(f"the chat template ends an assistant turn with {closing[:40]!r}, which starts with "
                                f"none of the stop tokens {self._stop_texts()}: a sampled turn could not end where "
                                f"the template expects")
        # the template's end-of-turn token: eos need not be it (Llama 3 tokenizers with eos <|end_of_text|> and
        # <|eot_id|> among the generation stop ids close every turn with <|eot_id|>)
        self.end_id = self.stop_ids[self._stop_texts().index(marker)]
        self._turn_end = _BASE[-1]["content"] + marker

    def _render(self, messages: list, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _stop_texts(self) -> list[str]:
        return [self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids]

    def _stop_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        gen = getattr(self.tokenizer, "generation_stop_ids", None) or []
        return [i for i in dict.fromkeys([*ids, *gen]) if i is not None]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, messages: list) -> list[int]:
        """The first prompt: the whole rendering of ``messages`` with the generation prompt."""
        return self._encode(self._render(messages, generation_prompt=True))

    def after_turn(self, messages: list) -> list[int]:
        """The ids after a model turn that ended on a stop token, up to the next generation prompt: the template's
        closing of that turn, ``messages`` rendered, and the assistant header."""
        grown = self._render(_BASE + list(messages), generation_prompt=True)
        # BASE's assistant turn may be rendered differently once messages follow it (Qwen3 drops the empty <think>
        # block it gives the last assistant turn): what matters is where that turn ends, not how it is written
        at = grown.find(self._turn_end)
        if at < 0:
            raise TemplateError(f"the chat template no longer ends an assistant turn with "
                                f"{self._turn_end[len(_BASE[-1]['content']):]!r} once messages follow it; the "
                                f"environment's tokens cannot be appended to what was sampled")
        return self._encode(grown[at + len(self._turn_end):])

    def ended(self, turn_ids: list[int]) -> bool:
        """Whether a sampled turn ends on a stop token (else it was cut by the length limit)."""
        return bool(turn_ids) and turn_ids[-1] in self.stop_ids

    def rewrites_history(self, messages: list) -> bool:
        """Whether rendering messages whole differs from building them turn by turn (Qwen3, token merges)."""
        return self.whole(messages) != self.incremental(messages)

    def whole(self, messages: list) -> list[int]:
        """``apply_chat_template`` over the whole conversation, with the generation prompt."""
        return self._encode(self._render(messages, generation_prompt=True))

    def incremental(self, messages: list) -> list[int]:
        """The same conversation built turn by turn: the first prompt, each assistant turn as a model emits it (its
        content's ids and the template's end-of-turn token), each run of other messages as ``after_turn``."""
        if not messages or messages[-1]["role"] == "assistant":
            raise ValueError("incremental: the conversation must end with a non-assistant message")
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        ids = self.prompt(messages[:first])
        i = first
        while i < len(messages):
            j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
            ids += self._encode(messages[i]["content"]) + [self.end_id] + self.after_turn(messages[i + 1:j])
            i = j
        return ids


def generation_stop_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """The eos ids of the checkpoint's ``generation_config.json`` besides the tokenizer's, in order (Llama 3.1 Instruct:
    <|end_of_text|>, <|eom_id|>): an agent's turn ends on them too. [] without the file; bad entries warn, left out."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s: not a readable generation config (%s); an agent's turns end on eos only", path, exc)
        return []
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokenizer)]
    if bad:
        log.warning("%s: eos_token_id entries %r are not token ids of the tokenizer (0 to %d); left out", path, bad,
                    len(tokenizer) - 1)
    return [i for i in dict.fromkeys(ids) if i not in bad and i != tokenizer.eos_token_id]
