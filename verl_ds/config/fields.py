"""One ``Spec`` per hyper-parameter, shared by the job config and SharedState: the same range, choices and
finiteness check a value loaded from YAML and one sent to ``PATCH /v1/state``, so the two can never disagree.
``check_value`` returns ``(value, None)`` or ``(None, reason)``; callers prefix the key."""
from __future__ import annotations

import difflib
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


class ConfigError(ValueError):
    """An invalid configuration: the message names the key, what was expected and what was found."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 6, 6, 120, 120, 60
_SHOW_CHARS = 200


def show(value) -> str:
    """``repr`` bounded in size and depth: a hostile value (YAML aliases can nest a list 10^9 items wide)
    must not make its own error message explode."""
    text = _REPR.repr(value)
    return text if len(text) <= _SHOW_CHARS else text[:_SHOW_CHARS - 3] + "..."


@dataclass(frozen=True)
class Spec:
    """What a value of one field may be, beyond its type annotation.

    lo/hi: bounds (None: unbounded), inclusive unless lo_open/hi_open. hot: the SharedState key that carries
    the field while training runs (None: fixed for the run). choices: allowed strings (a key naming a registry entry
    has none here: the registry checks it when the run is built). config_only: choices the config resolves before
    the run (never held by SharedState). finite: refuse NaN/inf. nonempty: refuse ''. items: the type of a list's items.
    secret: redacted on output.
    """

    help: str
    lo: Optional[float] = None
    lo_open: bool = False
    hi: Optional[float] = None
    hi_open: bool = False
    hot: Optional[str] = None
    choices: Optional[tuple] = None
    config_only: tuple = ()
    finite: bool = True
    nonempty: bool = False
    items: Optional[type] = None
    secret: bool = False

    def range_text(self) -> Optional[str]:
        """``"(0.0, 1.0]"``: parentheses mark open (or absent) bounds; None without bounds."""
        if self.lo is None and self.hi is None:
            return None
        left = "(" if (self.lo_open or self.lo is None) else "["
        right = ")" if (self.hi_open or self.hi is None) else "]"
        return f"{left}{'-inf' if self.lo is None else self.lo}, {'inf' if self.hi is None else self.hi}{right}"

    def out_of_range(self, value) -> bool:
        below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        above = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return below or above


def _f(default, help: str, *, min=None, max=None, gt=None, lt=None, **kw):
    """A dataclass field with its Spec: ``min``/``max`` are inclusive bounds, ``gt``/``lt`` exclusive ones."""
    if min is not None and gt is not None or max is not None and lt is not None:
        raise TypeError("give either min or gt, and either max or lt")
    spec = Spec(help, lo=gt if gt is not None else min, lo_open=gt is not None,
                hi=lt if lt is not None else max, hi_open=lt is not None, **kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"spec": spec})
    return field(default=default, metadata={"spec": spec})


def spec_of(f) -> Spec:
    """The Spec of a dataclass field declared with ``_f``."""
    return f.metadata["spec"]


# --------------------------------------------------------------------------- types


def _union_args(tp) -> Optional[tuple]:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else None


def nullable(tp) -> bool:
    args = _union_args(tp)
    return args is not None and type(None) in args


def base_type(tp):
    """``Optional[X]`` -> X; ``Literal[...]`` -> str; anything else unchanged."""
    args = _union_args(tp)
    if args is not None:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported field annotation {tp!r}: one type or Optional[type]")
        tp = rest[0]
    if typing.get_origin(tp) is Literal:
        return str
    return tp


def type_name(tp) -> str:
    if nullable(tp):
        return f"{type_name(base_type(tp))} or null"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def choices_of(tp, spec: Spec) -> Optional[tuple]:
    """Allowed values of a string field: its Literal arguments, else the Spec's choices."""
    inner = [a for a in (_union_args(tp) or (tp,)) if a is not type(None)]
    if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
        return typing.get_args(inner[0])
    return spec.choices


def suggest(name: str, options) -> str:
    close = difflib.get_close_matches(str(name), [str(o) for o in options], n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _type_error(tp, value) -> str:
    want = type_name(base_type(tp)) + (" or null" if nullable(tp) else "")
    if base_type(tp) is bool:
        want = "bool (true/false)" + (" or null" if nullable(tp) else "")
    return f"expected {want}, got {type(value).__name__} {show(value)}"


def check_value(tp, value: Any, spec: Spec) -> tuple[Any, Optional[str]]:
    """Check ``value`` against annotation ``tp`` and ``spec``: ``(normalised value, None)`` or ``(None, reason)``.

    Ints are accepted for floats (stored as float); nothing else converts.
    """
    if value is None:
        return (None, None) if nullable(tp) else (None, f"expected {type_name(base_type(tp))}, got None")
    base = base_type(tp)
    if base is bool:
        if not isinstance(value, bool):
            return None, _type_error(tp, value)
    elif base is int:
        if isinstance(value, bool) or not isinstance(value, int):  # True as a top_k is a bug, not a 1
            return None, _type_error(tp, value)
    elif base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, _type_error(tp, value)
        try:
            value = float(value)
        except OverflowError:  # an int beyond float range
            return None, f"expected a finite float, got an int of {len(str(value))} digits"
        if spec.finite and not math.isfinite(value):
            return None, f"expected a finite float, got {value!r}"
    elif base is str:
        if not isinstance(value, str):
            return None, _type_error(tp, value)
        if spec.nonempty and not value.strip():
            return None, f"must not be empty, got {show(value)}"
    elif base is list:
        if not isinstance(value, list):
            return None, _type_error(tp, value)
        if spec.items is not None:
            for i, item in enumerate(value):
                _, why = check_value(spec.items, item, Spec("", nonempty=spec.nonempty, choices=spec.choices))
                if why is not None:
                    return None, f"[{i}]: {why}"
        if spec.choices is not None and len(set(value)) < len(value):
            return None, f"lists {show(value)}: expected each value once"
        return list(value), None
    elif base is dict:
        if not isinstance(value, dict):
            return None, _type_error(tp, value)
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            return None, f"expected string keys, got {type(bad).__name__} {show(bad)}"
        return dict(value), None
    if isinstance(value, str):
        allowed = choices_of(tp, spec)
        if allowed is not None:
            allowed = tuple(spec.config_only) + tuple(allowed)
            if value not in allowed:
                return None, f"{show(value)} is not one of {list(allowed)}{suggest(value, allowed)}"
    elif spec.out_of_range(value):
        return None, f"{show(value)} is out of range {spec.range_text()}"
    return value, None
