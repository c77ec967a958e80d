"""Rule-based reward functions: the shipped ones by name, and user functions loaded from a module or file.
Signature: ``fn(prompts: list[str], responses: list[str], batch) -> list[float]``, one float per sample, with the
data set's pass-through fields in ``batch.extras`` (e.g. ``batch.extras["answer"]``)."""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from verl_ds.agent.code_reward import code_tests_reward
from verl_ds.tasks.gsm8k import exact_match_reward
from verl_ds.tasks.parity import parity_reward
from verl_ds.verifiable import format_reward, math_answer_reward

RewardFn = Callable[[list, list, Any], list]


@dataclass
class RewardBatch:
    """The minimal `batch` a reward function may rely on (for tests and offline scoring)."""
    extras: dict[str, list] = field(default_factory=dict)


REWARD_FNS: dict[str, RewardFn] = {
    "parity": parity_reward,
    "exact_match": exact_match_reward,
    "math_verify": math_answer_reward,  # needs pip install 'verl_ds[math]'
    "format": format_reward,  # <think>...</think> then an answer with \boxed{...}
    "code_tests": code_tests_reward,  # the last code block with the row's `tests`, in a sandbox (verl_ds.agent)
}
# the shipped functions above return one float per sample: per_token=True would fail at the first step
SEQUENCE_REWARDS = frozenset(REWARD_FNS)


def register_reward_fn(name: str, fn: RewardFn | None = None):
    """Add `fn` to REWARD_FNS under `name` (usable as a decorator); a name already taken raises."""
    def add(f):
        if name in REWARD_FNS:
            raise ValueError(f"reward function name {name!r} is already registered ({REWARD_FNS[name].__module__}."
                             f"{REWARD_FNS[name].__qualname__})")
        _check_signature(f, name)
        REWARD_FNS[name] = f
        return f
    return add if fn is None else add(fn)


def get_reward_fn(name: str) -> RewardFn:
    """The shipped reward function called `name`; an unknown name lists the valid ones and close matches."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    close = difflib.get_close_matches(str(name), REWARD_FNS, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"unknown reward function {name!r}; valid names: {sorted(REWARD_FNS)}.{hint} "
                     "(a user function is given as 'module.path:function' or '/path/file.py:function')")


def load_reward_fn(spec: str) -> RewardFn:
    """Load a user reward function from 'package.module:function' or '/path/to/file.py:function'."""
    if not isinstance(spec, str) or spec.count(":") < 1 or not all(spec.rpartition(":")[::2]):
        raise ValueError(f"reward function: expected 'module.path:function' or '/path/file.py:function', got {spec!r}")
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ValueError(f"reward function {spec!r}: module {where!r} not found ({e})") from e
        except Exception as e:
            raise ValueError(f"reward function {spec!r}: importing {where!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        names = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(attr, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f"; callables there: {sorted(names)[:10]}"
        raise ValueError(f"reward function {spec!r}: {where!r} has no attribute {attr!r}{hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    # a class would be instantiated, a C builtin (print, eval, os.system) would run on the texts: neither scores
    if inspect.isclass(fn) or isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        kind = "a class" if inspect.isclass(fn) else "a built-in function"
        raise TypeError(f"reward function {spec!r}: {attr!r} is {kind}, not a reward function; expected a Python "
                        "function (or callable object) fn(prompts, responses, batch) -> one float per response")
    _check_signature(fn, spec)
    return fn


def resolve_reward_fn(spec: str) -> RewardFn:
    """A shipped name ('parity') or a user spec ('module:function', '/path/file.py:function')."""
    return load_reward_fn(spec) if isinstance(spec, str) and ":" in spec else get_reward_fn(spec)


def _import_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise ValueError(f"reward function {spec!r}: file {path!r} does not exist")
    name = f"verl_ds_user_reward_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so pickling and dataclasses inside the user file work
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit too: the module must not stay half-imported
        sys.modules.pop(name, None)
        if not isinstance(e, Exception):
            raise
        raise ValueError(f"reward function {spec!r}: executing {path!r} failed: {type(e).__name__}: {e}") from e
    return module


def _check_signature(fn, label: str) -> None:
    try:
        inspect.signature(fn).bind([], [], None)
    except TypeError as e:
        raise TypeError(f"reward function {label!r} must accept (prompts, responses, batch): {e}") from None
    except ValueError:  # builtins without a signature: trust them
        pass


def unscorable_rows(dataset, functions: list, chunk: int = 256) -> dict[int, str]:
    """{item index: error} for the rows a reward function raises on, skipped before training, not mid-run."""
    fns = []
    for spec in functions:
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        if not spec.get("per_token", False):  # per-token functions need a real rollout batch
            fns.append((spec["name"], resolve_reward_fn(spec["name"])))
    return rows_failing(dataset, fns, chunk)


def rows_failing(dataset, fns: list, chunk: int = 256) -> dict[int, str]:
    """``unscorable_rows`` for resolved batch-mode functions ``[(name, fn)]``."""
    bad: dict[int, str] = {}
    items = [dataset[i] for i in range(len(dataset))]
    keys = sorted({k for item in items for k in item if k not in ("input_ids", "prompt")})
    for name, fn in fns:
        for lo in range(0, len(items), chunk):
            part = range(lo, min(lo + chunk, len(items)))
            try:
                _score_rows(fn, [items[i] for i in part], keys)
                continue
            except Exception:  # locate the rows: one call each
                pass
            for i in part:
                try:
                    _score_rows(fn, [items[i]], keys)
                except Exception as exc:
                    bad.setdefault(i, f"{name}: {type(exc).__name__}: {exc}")
    return bad


def _score_rows(fn, rows: list[dict], keys: list) -> None:
    fn([r["prompt"] for r in rows], [""] * len(rows), RewardBatch(extras={k: [r.get(k) for r in rows] for k in keys}))
