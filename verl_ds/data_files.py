"""Prompt files (JSON lines or one array, Parquet, a ``datasets`` directory) as ``(location, row, reason)``: a bad row
gets a reason instead of failing the file. JSON is read strictly where Python is lenient: huge integers, repeated keys,
NaN/Infinity/1e999 (not RFC 8259 numbers); docs/reliability.md, "Bad input"."""
from __future__ import annotations

import json
import math

Rows = list[tuple[str, object, "str | None"]]


class _HugeInt:
    """Stands for an integer literal too long to convert; its row is skipped."""


class _RepeatedKeys(dict):
    """An object in which some key appeared more than once (the last value is kept, as json does)."""


class _StrictJSON:
    """``json.loads`` with hooks that flag what the parser would accept silently or refuse with a traceback."""

    def __init__(self):
        self.flags: set[str] = set()
        self._decoder = json.JSONDecoder(parse_int=self._int, parse_float=self._float,
                                         parse_constant=self._constant, object_pairs_hook=self._object)

    def _int(self, text: str):
        try:
            return int(text)
        except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
            self.flags.add("huge_number")
            return _HugeInt()

    def _float(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            self.flags.add("non_finite_number")
        return value

    def _constant(self, text: str) -> float:
        self.flags.add("non_finite_number")
        return float(text)  # "NaN", "Infinity", "-Infinity"

    def _object(self, pairs: list):
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        self.flags.add("duplicate_key")
        return _RepeatedKeys(obj)

    def loads(self, text: str):
        """The parsed value; ``self.flags`` holds what was found in it."""
        self.flags = set()
        return self._decoder.decode(text)


# the order a row's reason is chosen in when several apply
_FLAG_ORDER = ("huge_number", "duplicate_key", "non_finite_number")


def _first(flags) -> str | None:
    return next((f for f in _FLAG_ORDER if f in flags), None)


def _flags_of(value) -> set:
    """What ``_StrictJSON`` would have flagged in one already parsed value (iterative: rows may nest deeply)."""
    found, stack = set(), [value]
    while stack:
        v = stack.pop()
        if isinstance(v, _HugeInt):
            found.add("huge_number")
        elif isinstance(v, float) and not math.isfinite(v):
            found.add("non_finite_number")
        elif isinstance(v, dict):
            if isinstance(v, _RepeatedKeys):
                found.add("duplicate_key")
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return found


def read_json_lines(path: str) -> Rows:
    """(location, row, reason) per non-blank line; a .json file holding one array is read as its elements."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    parser = _StrictJSON()
    if path.lower().endswith(".json") and data.lstrip()[:1] == b"[":
        try:
            array = parser.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            why = "nested too deeply to read" if isinstance(e, RecursionError) else e
            raise ValueError(f"data file {path!r}: not a valid JSON array ({why}); use JSON lines to skip bad rows "
                             "one by one") from None
        if not parser.flags:
            return [(f"item {i}", row, None) for i, row in enumerate(array)]
        return [(f"item {i}", row, _first(_flags_of(row))) for i, row in enumerate(array)]
    rows = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            rows.append((where, None, "non_utf8"))
            continue
        try:
            row = parser.loads(text)
        except json.JSONDecodeError:
            rows.append((where, None, "invalid_json"))
            continue
        except RecursionError:  # e.g. 50000 nested arrays: a row to skip, not a crash of the loader
            rows.append((where, None, "too_deep"))
            continue
        rows.append((where, row, _first(parser.flags)))
    return rows


def read_parquet(path: str) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path!r} needs pyarrow (pip install pyarrow)") from e
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:
        raise ValueError(f"data file {path!r}: cannot read as Parquet: {type(e).__name__}: {e}") from e
    return [(f"row {i}", row, None) for i, row in enumerate(records)]


def read_saved_dataset(path: str, split: str | None) -> Rows:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"reading the directory {path!r} needs the `datasets` package (pip install datasets)") from e
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise ValueError(f"data directory {path!r} is not a data set saved with datasets' save_to_disk "
                         f"({type(e).__name__}: {e})") from e
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None and len(names) == 1:
            split = names[0]
        elif split is None:
            split = "train" if "train" in ds else None
        if split not in ds:
            raise ValueError(f"data directory {path!r} holds splits {names}; set split to one of them (got {split!r})")
        ds = ds[split]
    elif split is not None:
        raise ValueError(f"split={split!r} given but {path!r} holds a single data set, not a DatasetDict")
    return [(f"row {i}", row, None) for i, row in enumerate(ds.to_list())]
