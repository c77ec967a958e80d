"""Environments by name: the registered ones (the built-in tasks included) or a user class as
``package.module:Class``."""
from __future__ import annotations

import difflib
import importlib

import verl_ds.agent.tasks  # noqa: F401  (registers the built-in environments)
from verl_ds.agent.env import ENVIRONMENTS, Environment

__all__ = ["BUILTIN_AGENT_TASKS", "environment_class", "make_environment"]

# environments whose data set, tokenizer and SFT warm-up are built in (verl_ds.agent.tiny, verl_ds.agent.warmup)
BUILTIN_AGENT_TASKS = ("calc", "guess_number")


def environment_class(spec: str) -> type:
    """The class a config names: a registered name, or ``package.module:Class``."""
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
        try:
            cls = getattr(importlib.import_module(where), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"environment {spec!r}: cannot load {attr!r} from {where!r} ({type(e).__name__}: {e})") from e
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"environment {spec!r} is {cls!r}, not a subclass of verl_ds.agent.Environment")
        return cls
    if spec not in ENVIRONMENTS:
        close = difflib.get_close_matches(spec, ENVIRONMENTS, n=2, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown environment {spec!r}; registered: {sorted(ENVIRONMENTS)}.{hint} (a user class is "
                         "given as 'package.module:Class')")
    return ENVIRONMENTS[spec]


def make_environment(spec: str, args: dict | None = None) -> Environment:
    """A new environment for one trajectory; bad arguments name the environment."""
    cls = environment_class(spec)
    try:
        return cls(**(args or {}))
    except TypeError as e:
        raise ValueError(f"environment {spec!r}: its arguments {sorted(args or {})} do not fit {cls.__name__}: {e}") from e
