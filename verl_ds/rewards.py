"""Rule-based reward functions: the shipped ones by name, and user functions loaded from a module or file.

Every reward function has the signature

    fn(prompts: list[str], responses: list[str], batch) -> list[float]

one float per sample, where `batch.extras: dict[str, list]` holds the data set's pass-through fields per sample
(e.g. `batch.extras["answer"]`). The trainer checks shape and finiteness of what comes back.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

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
}


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
    _check_signature(fn, spec)
    return fn


def resolve_reward_fn(spec: str) -> RewardFn:
    """A shipped name ('parity') or a user spec ('module:function', '/path/file.py:function')."""
    return load_reward_fn(spec) if isinstance(spec, str) and ":" in spec else get_reward_fn(spec)


def parse_reward_swap(spec: dict) -> dict:
    """Validate a reward swap request (the body of ``POST /v1/models/reward``) into
    ``{"functions": [{name, weight?, per_token?}], "model_path", "model_weight"}``.

    ``spec``: ``{"function": name}``, ``{"functions": [name | {name, weight, per_token}, ...]}`` and/or
    ``{"model_path": dir, "model_weight": w}``. Function names are resolved now, so a typo is refused
    at once instead of failing every rank at the next step boundary.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"reward swap: expected a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - {"function", "functions", "model_path", "model_weight"}
    if unknown:
        raise ValueError(f"reward swap: unknown field(s) {sorted(unknown)}; expected function, functions, "
                         "model_path, model_weight")
    listed = spec.get("functions") or []
    if not isinstance(listed, list):
        raise ValueError(f"reward swap: functions: expected a list, got {type(listed).__name__}")
    functions = list(listed) + ([spec["function"]] if spec.get("function") else [])
    model_path = spec.get("model_path")
    if not functions and not model_path:
        raise ValueError("reward swap: give 'function', 'functions' or 'model_path'")
    clean = []
    for i, f in enumerate(functions):
        item = {"name": f} if isinstance(f, str) else f
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or set(item) - {"name", "weight", "per_token"}:
            raise ValueError(f"reward swap: functions[{i}]: expected a name or {{name, weight, per_token}}, got {f!r}")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"reward swap: functions[{i}].weight: expected a number, got {weight!r}")
        resolve_reward_fn(item["name"])  # raises with the valid names and close matches
        clean.append(item)
    if model_path is not None and not os.path.isdir(str(model_path)):
        raise ValueError(f"reward swap: model_path {model_path!r} is not a local directory")
    weight = spec.get("model_weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
        raise ValueError(f"reward swap: model_weight: expected a number, got {weight!r}")
    return {"functions": clean, "model_path": model_path, "model_weight": weight}


def _import_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise ValueError(f"reward function {spec!r}: file {path!r} does not exist")
    name = f"verl_ds_user_reward_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so pickling and dataclasses inside the user file work
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"reward function {spec!r}: executing {path!r} failed: {type(e).__name__}: {e}") from e
    return module


def _check_signature(fn, label: str) -> None:
    try:
        inspect.signature(fn).bind([], [], None)
    except TypeError as e:
        raise TypeError(f"reward function {label!r} must accept (prompts, responses, batch): {e}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
