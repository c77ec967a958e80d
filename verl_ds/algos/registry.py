"""Name -> implementation registries for the swappable numerics, instead of if-chains: registering a name twice
raises, and an unknown name raises a ValueError listing the valid names and the closest.
"""
from __future__ import annotations

import difflib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Any
    meta: dict = field(default_factory=dict)


class Registry:
    """Thread-safe; ``what`` names an entry in messages ("KL kind"), ``noun`` the list ("kinds")."""

    def __init__(self, what: str, noun: str = "names"):
        self.what, self.noun = what, noun
        self._entries: dict[str, Entry] = {}
        self._alias: dict[str, str] = {}  # alias -> canonical name
        self._order: list[str] = []  # canonical names and their plain aliases, in registration order
        self._lock = threading.Lock()

    def register(self, name: str, *, aliases: tuple = (), **meta) -> Callable[[Any], Any]:
        """Decorator registering ``fn`` under ``name`` (plus aliases) with ``meta``; returns ``fn`` unchanged."""
        for n in (name, *aliases):
            if not isinstance(n, str) or not n:
                raise TypeError(f"{self.what} names must be non-empty strings, got {n!r}")

        def add(fn):
            with self._lock:
                for n in (name, *aliases):
                    if n in self._entries or n in self._alias:
                        owner = self._entries[self._canonical_locked(n)].fn
                        owner = getattr(owner, "fn", owner)  # a wrapper that keeps the function in .fn
                        where = f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', '?')}"
                        raise ValueError(f"{self.what} {n!r} is already registered ({where})")
                self._entries[name] = Entry(name, fn, dict(meta))
                self._order.append(name)
                for a in aliases:
                    self._alias[a] = name
                    self._order.append(a)
            return fn
        return add

    def unregister(self, name: str) -> None:
        """Remove the entry ``name`` (canonical) and its aliases (plugins that reload, tests)."""
        with self._lock:
            if name not in self._entries:
                raise ValueError(f"{self.what} {name!r} is not registered "
                                 f"(canonical names: {', '.join(self._entries)})")
            del self._entries[name]
            for alias in [a for a, target in self._alias.items() if target == name]:
                del self._alias[alias]
            self._order = [n for n in self._order if n in self._entries or n in self._alias]

    def _canonical_locked(self, name: str) -> str:
        if name in self._entries:
            return name
        return self._alias[name]

    def canonical(self, name) -> str:
        with self._lock:
            if isinstance(name, str) and (name in self._entries or name in self._alias):
                return self._canonical_locked(name)
            valid = tuple(self._order)
        close = difflib.get_close_matches(str(name), valid, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown {self.what} {name!r}; valid {self.noun}: {', '.join(valid)}{hint}")

    def entry(self, name) -> Entry:
        canonical = self.canonical(name)
        with self._lock:
            return self._entries[canonical]

    def get(self, name):
        return self.entry(name).fn

    def names(self, *, aliases: bool = True) -> tuple:
        """Registered names in registration order, each canonical name followed by its aliases."""
        with self._lock:
            return tuple(self._order) if aliases else tuple(self._entries)

    def view(self, *, aliases: bool = True) -> "NamesView":
        """A live read-only sequence of :meth:`names` (entries registered later show up in it)."""
        return NamesView(self, aliases=aliases)


class NamesView(Sequence):
    """A tuple-like live view of a registry's names (``in``, iteration, indexing, ``==`` a tuple)."""

    def __init__(self, registry: Registry, *, aliases: bool):
        self._registry, self._aliases = registry, aliases

    def _names(self) -> tuple:
        return self._registry.names(aliases=self._aliases)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, list, NamesView)):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())
