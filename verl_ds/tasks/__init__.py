"""Shipped tasks (`parity`, the default job, and a tiny `gsm8k`) and `builtin_task`, which picks what a config
without data files runs (its tokenizer, rows and warm-up demonstrations), so construction names no task."""
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

from verl_ds.config import ConfigError
from verl_ds.tasks import gsm8k, parity

__all__ = ["BuiltinTask", "builtin_task", "gsm8k", "parity"]


class BuiltinTask(NamedTuple):
    """Its tokenizer, prompt ``rows(n, seed)``, warm-up ``demonstrations(tokenizer, n, seed)``: (ids, mask), and the
    reward function that scores it (None: its environment does)."""
    tokenizer: Callable[[], Any]
    rows: Callable[[int, int], list]
    demonstrations: Callable[[Any, int, int], list]
    warmup_lr: Optional[float] = None  # None: the actor's
    rule: Optional[str] = None


def builtin_task(cfg) -> Optional[BuiltinTask]:
    """None with ``data.train_files``; else parity, or ``agent.environment``'s built-in task."""
    from verl_ds.agent import tiny, warmup
    from verl_ds.tokenizer import build_tokenizer

    env = cfg.agent.environment
    if cfg.data.train_files is not None:
        return None
    if env is None:  # parity's own small vocabulary: a fresh model samples task words, not hundreds of others
        return BuiltinTask(partial(build_tokenizer, parity.VOCAB), parity.generate_prompts, parity.demonstrations,
                           rule="parity")
    if env not in tiny.BUILTIN_TASKS:
        raise ConfigError(f"agent.environment={env!r} has no built-in data set (only {list(tiny.BUILTIN_TASKS)} do); "
                          "set data.train_files to rows its reset takes")
    return BuiltinTask(tiny.build_agent_tokenizer, partial(tiny.builtin_rows, env), partial(warmup.demonstrations, env),
                       warmup.WARMUP_LR)
