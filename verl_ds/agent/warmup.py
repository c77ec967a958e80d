"""A cold start for the built-in agent tasks before RL, as tool-RL recipes do (ReTool, arXiv:2504.11536; ToolRL,
arXiv:2504.13958): supervised training on demonstrations, a weak policy on purpose (``CALL_FRACTION`` and below;
docs/agents.md), so a model from scratch learns to call and copy a result while RL still has the choice to learn."""
from __future__ import annotations

import random

from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.registry import make_environment
from verl_ds.agent.tiny import builtin_rows

__all__ = ["demonstrations", "demonstration", "demonstration_tokens", "CALL_FRACTION", "FEEDBACK_FRACTION"]

CALL_FRACTION = 0.02  # calc: the share of labelled first-token decisions that open a tool call
SKILL_FRACTION = 0.8  # calc: the share of conversations that call the tool (most with the decision unlabelled)
FEEDBACK_FRACTION = 0.5  # guess_number guesses that stay within the range the feedback left
GUESS_TURNS = 5  # a guess_number demonstration gives up after this many wrong guesses
WARMUP_LR = 1e-3  # the cold start's learning rate, whatever the engine's optimizer was built with (actor.lr is RL's)


def _call(expression: str) -> str:
    return f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def _turns(env_name: str, row: dict, rng: random.Random) -> list[str]:
    """The demonstrating policy's turns (guess_number's follow the feedback, replayed here from the secret)."""
    if env_name == "calc":
        if rng.random() < SKILL_FRACTION:
            return [_call(row["expression"]), row["answer"]]
        width = len(row["answer"])  # a plausible number: the answer's length, digits from the head
        return [str(rng.randint(10 ** (width - 1) if width > 1 else 0, 10 ** width - 1))]
    low, high, secret, turns = 1, int(row["high"]), int(row["secret"]), []
    tried = set()
    while len(turns) < GUESS_TURNS:
        if rng.random() < FEEDBACK_FRACTION:
            guess = rng.randint(low, high)
        else:
            guess = rng.choice([g for g in range(1, int(row["high"]) + 1) if g not in tried] or [secret])
        tried.add(guess)
        turns.append(str(guess))
        if guess == secret:
            break
        low, high = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
    return turns


def demonstration(env_name: str, row: dict, rng: random.Random) -> list[dict]:
    """One demonstration conversation on ``row``, driven by the real environment."""
    env = make_environment(env_name)
    messages = list(env.reset(row))
    for turn in _turns(env_name, row, rng):
        messages.append({"role": "assistant", "content": turn})
        step = env.step(turn)
        messages += step.messages
        if step.done:
            break
    return messages


def demonstration_tokens(chat: ChatTokens, messages: list, decision: bool = True) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation as a rollout builds it: mask 1 on each assistant turn's ids and the template's
    end-of-turn token (``ChatTokens.end_id``), except the first turn's first token when ``decision`` is False."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = chat.prompt(messages[:first])
    mask = [0] * len(ids)
    decision_at = len(ids)
    i = first
    while i < len(messages):
        turn = chat.tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [chat.end_id]
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        after = chat.after_turn(messages[i + 1:j]) if j < len(messages) else []
        ids += turn + after
        mask += [1] * len(turn) + [0] * len(after)
        i = j
    if not decision:
        mask[decision_at] = 0
    return ids, mask


def _decision_kept(messages: list, rng: random.Random) -> bool:
    """Whether a calc conversation's first token is labelled: every direct answer's, and a calling one's with the
    probability q that makes calls CALL_FRACTION of the labelled decisions (s q / (s q + 1 - s) = f)."""
    first = next(m for m in messages if m["role"] == "assistant")
    if not first["content"].startswith("<tool_call>"):
        return True
    s, f = SKILL_FRACTION, CALL_FRACTION
    return rng.random() < f * (1 - s) / (s * (1 - f))


def demonstrations(env_name: str, tokenizer, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (ids, mask) demonstrations of ``env_name`` (the same on every rank), on rows apart from the training
    rows; ``random`` is drawn as the first cold start drew it (16 conversations, then their decisions)."""
    rows = builtin_rows(env_name, n, seed=seed + 1_000_003)
    chat = ChatTokens(tokenizer, getattr(make_environment(env_name).tools, "schemas", None))
    rng, out = random.Random(seed * 7919 + 17), []
    for i in range(0, n, 16):
        conversations = [demonstration(env_name, r, rng) for r in rows[i:i + 16]]
        decisions = [env_name != "calc" or _decision_kept(c, rng) for c in conversations]
        out += [demonstration_tokens(chat, c, d) for c, d in zip(conversations, decisions)]
    return out
