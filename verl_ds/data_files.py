"""Data files as rows (JSON lines or one array, Parquet, a ``datasets`` directory) and the data set base over them:
a bad row gets a reason instead of failing the file. Why and which reasons: docs/reliability.md, "Bad input"."""
from __future__ import annotations

import inspect
import json
import math
import os

import torch

Rows = list[tuple[str, object, "str | None"]]  # (location, row, reason it is unusable or None)
# Why a row is skipped before any data set reads it (or, "duplicate_row", kept and counted), as `report()` counts it.
FILE_REASONS = {
    "non_utf8": "line is not valid UTF-8",
    "invalid_json": "line is not valid JSON",
    "huge_number": "an integer has more digits than Python converts (sys.get_int_max_str_digits(), 4300 by default)",
    "duplicate_key": "a JSON object repeats a key (which value was meant is ambiguous)",
    "non_finite_number": "a number is NaN, Infinity or beyond float range (e.g. 1e999); JSON has no such numbers",
    "too_deep": "line is JSON nested too deeply to read",
    "not_an_object": "row is not a JSON object",
    "duplicate_row": "the same row as an earlier one in the file (kept: repeats weight a row, maybe by mistake)",
}
_SHOW = 3  # locations listed per reason in summary()


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


def read_rows(path: str, split: str | None = None) -> Rows:
    """The rows of a .jsonl / .ndjson / .json / .parquet file or a datasets save_to_disk directory."""
    if not os.path.exists(path):
        raise ValueError(f"data file {path!r} does not exist")
    if os.path.isdir(path):
        return read_saved_dataset(path, split)
    ext = os.path.splitext(path)[1].lower()
    readers = {".jsonl": read_json_lines, ".ndjson": read_json_lines, ".json": read_json_lines,
               ".parquet": read_parquet}
    if ext not in readers:
        raise ValueError(f"data file {path!r}: unsupported extension {ext!r}; expected one of "
                         f"{sorted(readers)} or a directory saved with datasets' save_to_disk")
    return readers[ext](path)


def is_messages(value) -> bool:
    """A chat: a non-empty list of {"role": str, "content": str}."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def has_surrogates(texts) -> bool:
    """Unpaired surrogates: JSON escapes allow them, UTF-8 (and so a tokenizer) cannot encode them."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _choices(options: tuple) -> str:
    return ", ".join(map(repr, options[:-1])) + f" or {options[-1]!r}"


class RowDataset(torch.utils.data.Dataset):
    """Items built row by row from a file or records: a bad row is skipped and counted under a key of ``REASONS``
    (never raised), repeats in a file are kept and counted. A subclass writes only ``_items``, its rows' format."""

    REASONS = FILE_REASONS
    OVERLONG = ("truncate", "skip")
    ROWS = "rows"  # summary(): "kept 3 of 4 rows"
    NOUN, EXPECTED = "rows", ""  # the error for zero usable rows: "no usable {NOUN} ({EXPECTED}; fields ..."

    def __init__(self, items: list[dict], problems: dict[str, list[str]], n_rows: int, source: str, where: list[str]):
        self.items, self.problems, self.n_rows, self.source, self.where = items, problems, n_rows, source, where

    @classmethod
    def _items(cls, rows: Rows, tokenizer, bad, *, source: str, **options):
        """Yield ``(where, row, item)`` per usable row; call ``bad(reason, where)`` for each other one."""
        raise NotImplementedError(f"{cls.__name__} must define _items (its rows' format)")

    @classmethod
    def from_file(cls, path, tokenizer, *, split: str | None = None, **options):
        """Load a file ``read_rows`` reads (``split`` picks from a DatasetDict); options as ``from_records``."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a file or directory path, got {type(path).__name__}")
        path = os.fspath(path)
        valid = [k for k in inspect.signature(cls._items).parameters if k not in ("rows", "tokenizer", "bad", "source")]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TypeError(f"{cls.__name__}.from_file: unknown options {unknown}; valid: {valid}")
        return cls._build(read_rows(path, split), tokenizer, source=path, count_duplicates=True, **options)

    @classmethod
    def from_records(cls, records, tokenizer, *, source: str = "records", **options):
        """Build from a list of dicts; ``options`` are ``_items``' keywords. Generated sets repeat rows by design, so
        repeats are counted in files only."""
        if isinstance(records, (str, bytes, dict)) or not hasattr(records, "__iter__"):
            raise TypeError(f"records: expected a list of dicts, got {type(records).__name__}")
        return cls._build([(f"record {i}", row, None) for i, row in enumerate(records)], tokenizer, source=source,
                          **options)

    @classmethod
    def _build(cls, rows: Rows, tokenizer, *, source: str, count_duplicates: bool = False, **options):
        for name in ("max_prompt_length", "max_completion_length"):
            value = options.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected a positive int or None, got {value!r}")
        if options.get("overlong", "truncate") not in cls.OVERLONG:
            raise ValueError(f"overlong: expected {_choices(cls.OVERLONG)}, got {options['overlong']!r}")
        if not callable(tokenizer):
            raise TypeError(f"tokenizer: expected a HuggingFace tokenizer, got {type(tokenizer).__name__}")
        problems: dict[str, list[str]] = {}

        def bad(reason: str, where: str) -> None:
            problems.setdefault(reason, []).append(where)

        items, kept, first_seen = [], [], {}
        for where, row, item in cls._items(rows, tokenizer, bad, source=source, **options):
            if count_duplicates:  # kept (a repeat weights a row, maybe by mistake) but counted; any key order
                key = json.dumps(row, sort_keys=True, default=repr, ensure_ascii=False)
                if key in first_seen:
                    bad("duplicate_row", f"{where}={first_seen[key]}")
                else:
                    first_seen[key] = where
            items.append(item)
            kept.append(where)
        dataset = cls(items, problems, len(rows), source, kept)
        if not items:
            fields = next((sorted(row) for _, row, _ in rows if isinstance(row, dict)), [])
            expected = cls.EXPECTED.format(prompt_key=options.get("prompt_key", "prompt"))
            raise ValueError(f"{source}: no usable {cls.NOUN} ({expected}; fields of the first row: {fields}). "
                             f"{dataset.summary()}")
        return dataset

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def drop(self, indices, reason: str) -> None:
        """Remove the items at ``indices``, counting their rows under ``reason`` (a key of REASONS)."""
        if reason not in self.REASONS:
            raise ValueError(f"drop: unknown reason {reason!r}; reasons: {sorted(self.REASONS)}")
        gone = set(indices)
        for i in sorted(gone):
            self.problems.setdefault(reason, []).append(self.where[i])
        self.items = [x for i, x in enumerate(self.items) if i not in gone]
        self.where = [w for i, w in enumerate(self.where) if i not in gone]

    def report(self) -> dict[str, int]:
        """{reason: count} of the rows skipped, truncated or repeated; empty when all rows were clean."""
        return {reason: len(where) for reason, where in self.problems.items()}

    def summary(self) -> str:
        """One line: rows read, kept, and each reason with its count and first locations."""
        head = f"{self.source}: kept {len(self.items)} of {self.n_rows} {self.ROWS}"
        return "; ".join([head] + [_describe(reason, where) for reason, where in self.problems.items()])


def _describe(reason: str, where: list[str]) -> str:
    more = f", +{len(where) - _SHOW} more" if len(where) > _SHOW else ""
    return f"{reason} {len(where)} ({', '.join(where[:_SHOW])}{more})"
