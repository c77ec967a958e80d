"""JSON in and out of the control server: strict request parsing and answers that are always valid JSON."""
from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["HTTPError", "parse_json_object", "dumps", "json_kind", "MAX_JSON_DEPTH"]

# Control requests nest at most 3 levels ({"functions": [{...}]}); the margin is generous. The limit is
# checked before parsing, so a body of 100000 '[' is a 400 instead of a RecursionError in the parser.
MAX_JSON_DEPTH = 32
# The bytes that can open or close a string or a level, or escape the next byte: one linear pass over their
# positions finds the depth (_depth); a regex over whole strings backtracks on an unterminated one (docs/http_api.md).
_SPECIAL = re.compile(rb'["\\\[\]{}]')


class HTTPError(Exception):
    """Raised inside a request to answer ``status`` with a JSON error body ``{"error", "status", **extra}``.
    ``close``: end the connection after the answer (e.g. an unread or partly read body is in the socket)."""

    def __init__(self, status: int, message: str, headers: dict | None = None, close: bool = False, **extra):
        super().__init__(message)
        self.status, self.message, self.headers, self.close, self.extra = status, message, dict(headers or {}), close, extra


def json_kind(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed (JSON numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e309 parses to inf without passing through parse_constant
        raise ValueError(f"number {text[:40]} overflows to infinity (JSON numbers must be finite)")
    return value


def _depth(raw: bytes) -> int:
    """Deepest nesting of arrays/objects in ``raw`` (not counting brackets in strings): one pass, constant memory."""
    depth = deepest = 0
    in_string, escaped = False, -1  # escaped: the position of a byte that a backslash in a string escapes
    for m in _SPECIAL.finditer(raw):
        pos = m.start()
        if pos == escaped:
            continue
        c = raw[pos]
        if in_string:
            if c == 0x5C:  # backslash
                escaped = pos + 1
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object: UTF-8, finite numbers, no duplicate keys, at most MAX_JSON_DEPTH
    levels deep; HTTPError 400 naming what is wrong otherwise."""
    if not raw:
        raise HTTPError(400, "request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"request body is not UTF-8: {e}") from None
    depth = _depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise HTTPError(400, f"request body nests JSON arrays/objects {depth} levels deep; at most {MAX_JSON_DEPTH} "
                             "are allowed (control requests need 3)")
    try:
        body = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant,
                          parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError, and so are the hooks' errors
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"request body must be a JSON object, got a JSON {json_kind(body)}")
    return body


def _finite_only(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)  # 'nan' / 'inf' as strings: the answer stays valid JSON
    if isinstance(obj, dict):
        return {k: _finite_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_only(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    """``obj`` as indented JSON bytes; never the non-JSON ``NaN``/``Infinity`` (non-finite floats become strings)."""
    try:
        text = json.dumps(obj, default=str, indent=1, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite_only(obj), default=str, indent=1, allow_nan=False)
    return (text + "\n").encode("utf-8")
