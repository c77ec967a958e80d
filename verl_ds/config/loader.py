"""Reading a config: a YAML file (strict: no duplicate keys, bounded nesting) plus ``section.key=value``
overrides, checked key by key against the schema. Every failure is one ConfigError line naming the file or key."""
from __future__ import annotations

import os
import re
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Optional

import yaml

from .fields import ConfigError, check_value, show, spec_of, suggest, type_name
from .folded import FOLDED_KEYS, folded_message
from .schema import REMOVED_KEYS, Config, iter_fields

MAX_DEPTH = 64  # a config is 3 levels deep; 64 leaves room for data in lists and refuses hostile nesting
MAX_BYTES = 16 << 20


class _TooDeep(yaml.MarkedYAMLError):
    pass


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML 1.1 keeps the last one silently) and nesting deeper than
    MAX_DEPTH (PyYAML composes recursively), and reads ``1e-3`` as a float as ML configs mean it."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(problem=f"nested deeper than {MAX_DEPTH} levels", problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges may override keys: that is their point
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first_line
                except TypeError:  # an unhashable key: the base constructor says so
                    continue
                if seen:
                    raise _DuplicateKey(problem=f"duplicate key {key!r} (first at line {first_line[key]})",
                                        problem_mark=key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_error_text(exc: Exception) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def yaml_load(text: str, what: str) -> Any:
    """Parse YAML ``text`` with the strict loader; ``what`` names the source in the ConfigError."""
    try:
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as exc:
        raise ConfigError(f"{what}: {_yaml_error_text(exc)}; each key may appear once") from None
    except _TooDeep as exc:
        raise ConfigError(f"{what}: {_yaml_error_text(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {_yaml_error_text(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{what}: nested too deeply to read") from None


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of ``path``; ConfigError (``what``, the path, the problem) when it is not a readable file."""
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory; expected a file")
    if not os.path.exists(path):
        raise ConfigError(f"{what} {path!r} does not exist")
    if not os.path.isfile(path):  # a FIFO or device would block or never end
        raise ConfigError(f"{what} {path!r} is not a regular file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{what} {path!r} is larger than {MAX_BYTES >> 20} MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path!r} is not UTF-8 text (byte {exc.start})") from None


def _build(cls, data, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {show(data)}")
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in by_name:
            if prefix + str(key) in FOLDED_KEYS:
                raise ConfigError(folded_message(prefix + str(key), value))
            if prefix + str(key) in REMOVED_KEYS:
                raise ConfigError(f"{prefix}{key}: this key was removed; {REMOVED_KEYS[prefix + str(key)]}")
            raise ConfigError(f"unknown config key {show(prefix + str(key))}{suggest(str(key), by_name)} "
                              f"(valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(by_name)})")
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{prefix}{key}.")
            continue
        spec = spec_of(by_name[key])
        checked, why = check_value(tp, value, spec)
        if why is not None and spec.secret:  # by key, whatever the value's type: 12345678 is a token too
            raise ConfigError(f"{prefix}{key}: expected {type_name(tp)}, got {type(value).__name__} (the value is "
                              "not shown: the key is a secret)")
        value = checked
        if why is not None:
            raise ConfigError(f"{prefix}{key}{'' if why.startswith('[') else ': '}{why}")
        kwargs[key] = value
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"override key {dotted!r}: expected section.key")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'actor.lr=1e-4'`` -> ``('actor.lr', 0.0001)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    if any(spec.secret and dotted == key for dotted, _, spec, _ in iter_fields()):  # no value, nor YAML's quote of it
        try:
            return key, yaml_load(raw, "") if raw.strip() else ""
        except ConfigError:
            raise ConfigError(f"override {key}=...: the value is not valid YAML (the value is not shown: the key "
                              "is a secret)") from None
    value = yaml_load(raw, f"override {text[:80]!r}") if raw.strip() else ""
    return key, value


def _check_repeat(given: dict, key: str, n: int) -> None:
    """Refuse a key given twice among the overrides (also as a section and a key in it): the last one would win
    silently, and which one the user meant is not knowable. Values are not shown (one may be a secret)."""
    for other, first in given.items():
        if key == other or key.startswith(other + ".") or other.startswith(key + "."):
            what = f"{key}: given twice" if key == other else f"{key}: overlaps {other!r}"
            raise ConfigError(f"{what} among the overrides (overrides {first} and {n}); give each key once")
    given[key] = n


def load_config(path: Optional[str] = None, overrides: Optional[list] = None) -> Config:
    """Load a YAML file (optional) and apply ``key.sub=value`` overrides onto the defaults."""
    tree: Any = {}
    if path is not None:
        what = f"config file {path!r}"
        tree = yaml_load(read_text_file(path, "config file"), what)
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{what}: expected a mapping at the top level, got {type(tree).__name__}")
    given: dict[str, int] = {}
    for n, item in enumerate(overrides or [], start=1):
        key, value = parse_override(item)
        _check_repeat(given, key, n)
        _set_dotted(tree, key, value)
    return _build(Config, tree, "")
