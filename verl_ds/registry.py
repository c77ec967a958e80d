"""ModelRegistry: name -> model, with aliases, atomic hot swap (immutable entries replaced in one dict assignment)
and a version per name; and the class table that ``BaseModel.__init_subclass__`` fills."""
from __future__ import annotations

import difflib
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelRegistry", "UnknownModelError", "model_classes", "register_model_class"]

_MISSING = object()


class UnknownModelError(KeyError):
    """A name that is neither registered nor an alias; the message suggests close matches."""

    def __str__(self):  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class _Entry:
    model: Any
    version: int
    registered_at: float


def _close_matches(name: str, pool: list[str]) -> str:
    close = difflib.get_close_matches(str(name), pool, n=3, cutoff=0.5)
    # 'reward_model' vs 'reward': difflib's ratio alone misses long suffixes; prefixes count too
    for p in pool:
        if p not in close and min(len(p), len(str(name))) >= 3 and (str(name).startswith(p) or p.startswith(str(name))):
            close.append(p)
    return f"; did you mean {' or '.join(repr(c) for c in close[:3])}?" if close else ""


def _torch_modules(model: Any) -> list:
    import torch.nn as nn

    if isinstance(model, nn.Module):
        return [model]
    fn = getattr(model, "torch_modules", None)
    return list(fn()) if callable(fn) else []


def _param_stats(model: Any) -> tuple[bool | None, int | None]:
    """(trainable, num_parameters) of the modules the model wraps; ZeRO-3 parameters count ``ds_numel`` (numel is 0)."""
    modules = _torch_modules(model)
    if not modules:
        return None, None
    seen, total, trainable = set(), 0, False
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += int(getattr(p, "ds_numel", p.numel()))
            trainable = trainable or bool(p.requires_grad)
    return trainable, total


class ModelRegistry:
    """Thread-safe name -> instance map with aliases."""

    def __init__(self):
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._aliases: dict[str, str] = {}  # alias -> canonical name
        self._last_version: dict[str, int] = {}  # survives unregister so versions never repeat

    def register(self, name: str, model: Any, aliases: tuple[str, ...] | list[str] = ()) -> int:
        """Register (or atomically replace, bumping its version) ``name`` with more ``aliases``; the new version."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"model name must be a non-empty str, got {name!r}")
        if model is None:
            raise ValueError(f"cannot register None as model {name!r}; unregister({name!r}) removes a model")
        if isinstance(aliases, str):
            aliases = (aliases,)
        with self._lock:
            if name in self._aliases:
                raise ValueError(f"{name!r} is already an alias of {self._aliases[name]!r}; "
                                 f"register under {self._aliases[name]!r} or unregister the alias first")
            for a in aliases:
                if not isinstance(a, str) or not a or a == name:
                    raise ValueError(f"alias of {name!r} must be a non-empty str other than the name, got {a!r}")
                if a in self._entries:
                    raise ValueError(f"alias {a!r} of {name!r} is already a registered model name")
                if self._aliases.get(a, name) != name:
                    raise ValueError(f"alias {a!r} already points to {self._aliases[a]!r}")
            version = self._last_version.get(name, 0) + 1
            self._entries[name] = _Entry(model, version, time.time())
            self._last_version[name] = version
            for a in aliases:
                self._aliases[a] = name
            return version

    def unregister(self, name: str) -> Any:
        """Remove a name (or the name an alias points to) and its aliases; returns the model."""
        with self._lock:
            canonical = self._resolve(name)
            entry = self._entries.pop(canonical)
            self._aliases = {a: n for a, n in self._aliases.items() if n != canonical}
            return entry.model

    def _resolve(self, name: str) -> str:
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        pool = sorted(set(self._entries) | set(self._aliases))
        raise UnknownModelError(f"{name!r} is not registered{_close_matches(name, pool)} Registered: {pool}")

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The instance under ``name`` or an alias; unknown: ``default`` if given, else UnknownModelError."""
        with self._lock:
            try:
                return self._entries[self._resolve(name)].model
            except UnknownModelError:
                if default is _MISSING:
                    raise
                return default

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries or name in self._aliases

    def names(self) -> list[str]:
        """Registered canonical names, sorted."""
        with self._lock:
            return sorted(self._entries)

    def aliases(self, name: str | None = None) -> dict[str, str] | list[str]:
        """All aliases as {alias: name}, or the aliases of one name as a sorted list."""
        with self._lock:
            if name is None:
                return dict(self._aliases)
            canonical = self._resolve(name)
            return sorted(a for a, n in self._aliases.items() if n == canonical)

    def version(self, name: str) -> int:
        """The version of ``name`` (1 at first registration, +1 at each swap)."""
        with self._lock:
            return self._entries[self._resolve(name)].version

    def versions(self) -> dict[str, int]:
        """{name: version} of every registered name (saved in checkpoints)."""
        with self._lock:
            return {n: e.version for n, e in self._entries.items()}

    def restore_versions(self, versions: dict[str, int]) -> None:
        """Set the versions of registered names to the saved ones (a resumed run reports what the saved run did)."""
        with self._lock:
            missing = sorted(set(versions) - set(self._entries))
            if missing:
                raise KeyError(f"restore_versions: {missing} not registered here; registered: {sorted(self._entries)}")
            for name, version in versions.items():
                if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                    raise ValueError(f"restore_versions: version of {name!r} must be an int >= 1, got {version!r}")
                entry = self._entries[name]
                self._entries[name] = _Entry(entry.model, version, entry.registered_at)
                self._last_version[name] = max(self._last_version.get(name, 0), version)

    def snapshot(self) -> list[dict]:
        """One dict per name: {name, aliases, class, version, registered_at, trainable, num_parameters}."""
        with self._lock:
            items = [(n, e, sorted(a for a, c in self._aliases.items() if c == n)) for n, e in self._entries.items()]
        out = []
        for name, entry, aliases in sorted(items, key=lambda t: t[0]):
            trainable, numel = _param_stats(entry.model)
            out.append({"name": name, "aliases": aliases, "class": type(entry.model).__name__,
                        "version": entry.version, "registered_at": entry.registered_at,
                        "trainable": trainable, "num_parameters": numel})
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


# ---- class table ------------------------------------------------------------------------------------
_CLASSES: dict[str, type] = {}
_CLASSES_LOCK = threading.Lock()


def register_model_class(cls: type) -> None:
    """Record a concrete model class under its ``__name__`` (a later one replaces it: re-imports work)."""
    with _CLASSES_LOCK:
        _CLASSES[cls.__name__] = cls


def model_classes() -> dict[str, type]:
    """name -> concrete BaseModel subclass, as filled by ``BaseModel.__init_subclass__``."""
    with _CLASSES_LOCK:
        return dict(_CLASSES)
