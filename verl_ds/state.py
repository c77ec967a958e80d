"""SharedState: the run's cross-model hyper-parameters, written by rank 0 and broadcast at each step boundary.
Hot keys come from the config fields declaring ``hot=<key>`` (same default, range and help); the rest are written
by the trainer only. Keys, staging and the audit log: docs/http_api.md (``/v1/state``) and docs/config.md."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from verl_ds.config import Config, RunLimits, Spec, check_value, hot_fields
from verl_ds.config.fields import base_type, choices_of, nullable
from verl_ds.resolved_config import initial_state, registry_choices, run_limits

__all__ = ["StateKey", "SharedState", "StateValidationError", "UnknownStateKeyError", "SnapshotError", "STATE_KEYS",
           "HOT_KEYS"]

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str"}
_FORMAT = 1  # version of the state_dict / JSON layout


@dataclass(frozen=True)
class StateKey:
    """One SharedState key; ``hot`` keys may be staged while training runs, the others only ``set`` by the trainer."""

    name: str
    annotation: Any
    default: Any
    spec: Spec
    hot: bool = False
    config_key: Optional[str] = None

    @property
    def type(self) -> type:
        return base_type(self.annotation)

    @property
    def range(self) -> tuple | None:
        """(low, high), either may be None (unbounded); None for keys without bounds."""
        return None if self.spec.range_text() is None else (self.spec.lo, self.spec.hi)

    @property
    def choices(self) -> tuple | None:
        return choices_of(self.annotation, self.spec)

    @property
    def description(self) -> str:
        return self.spec.help

    def check(self, value: Any) -> tuple[Any, str | None]:
        """Return (normalised value, None) or (None, reason why the value is refused)."""
        return check_value(self.annotation, value, self.spec)

    def schema(self) -> dict:
        return {
            "type": _TYPE_NAMES[self.type],
            "default": self.default,
            "range": None if self.range is None else list(self.range),
            "range_text": self.spec.range_text(),  # "(0.0, 100.0]": parentheses mark open bounds
            "choices": None if self.choices is None else list(self.choices),
            "hot": self.hot,
            "nullable": nullable(self.annotation),
            "description": self.description,
            "config_key": self.config_key,
        }


def _hot_keys() -> list[StateKey]:
    defaults = initial_state(Config())
    out = []
    for key, dotted, annotation, spec in hot_fields():
        allowed = choices_of(annotation, spec) or registry_choices().get(dotted)
        if allowed is not None:  # concrete names only: the config resolves its 'auto' before the run
            spec = dataclasses.replace(spec, choices=tuple(allowed), config_only=())
        out.append(StateKey(key, annotation, defaults[key], spec, hot=True, config_key=dotted))
    return out


def _read_only(name: str, annotation, default, help: str, **bounds) -> StateKey:
    return StateKey(name, annotation, default, Spec(help, **bounds))


STATE_KEYS: dict[str, StateKey] = {k.name: k for k in _hot_keys() + [
    _read_only("global_step", int, 0, "optimizer steps completed", lo=0),
    _read_only("epoch", int, 0, "passes over the prompt data completed", lo=0),
    _read_only("actor_version", int, 0, "actor optimizer steps taken (bumped whenever the actor weights change)", lo=0),
    _read_only("reward_version", int, 0, "bumped whenever the reward model/functions are swapped", lo=0),
    _read_only("best_reward", Optional[float], None, "best mean reward seen so far (None before the first)"),
    _read_only("reward_name", str, "", "name of the active reward (model or function set)"),
]}
HOT_KEYS: tuple[str, ...] = tuple(k for k, d in STATE_KEYS.items() if d.hot)
assert len(HOT_KEYS) == 18, HOT_KEYS


class StateValidationError(ValueError):
    """One or more keys were refused. ``errors`` maps each offending key to the reason."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        lines = "; ".join(f"{k}: {v}" for k, v in self.errors.items())
        super().__init__(f"SharedState refused {len(self.errors)} key(s): {lines}")


class UnknownStateKeyError(KeyError):
    """An undeclared key was read; the message lists close matches and the valid keys."""

    def __str__(self):  # KeyError would repr() the message
        return str(self.args[0])


class SnapshotError(ValueError):
    """A file that is not a SharedState snapshot (or a checkpoint holding one); the message names the path."""


def _unknown_key_message(key: Any) -> str:
    close = difflib.get_close_matches(str(key), list(STATE_KEYS), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown SharedState key {key!r}{hint} Valid keys: {sorted(STATE_KEYS)}"


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class SharedState:
    """Thread-safe store of the declared keys; only rank 0 writes. ``rank=None`` asks torch.distributed at each
    call, so a state built before ``init_process_group`` is still right."""

    def __init__(self, rank: int | None = None, limits: RunLimits | None = None):
        if limits is not None and not isinstance(limits, RunLimits):
            raise TypeError(f"limits must be a RunLimits (from verl_ds.resolved_config.run_limits(cfg)), got "
                            f"{type(limits).__name__}")
        self._rank = rank
        self._limits = limits
        self._lock = threading.RLock()
        self._values: dict[str, Any] = {k: d.default for k, d in STATE_KEYS.items()}
        self._version = 0
        self._staged: list[dict] = []
        self.on_stage: Optional[Callable[[list[dict], int], None]] = None  # stage()'s journal (verl_ds.step_boundary)

    @classmethod
    def from_config(cls, cfg: Config, rank: int | None = None) -> "SharedState":
        """The run's limits and step-0 values, the same on every rank without a collective."""
        state = cls(rank, limits=run_limits(cfg))
        with state._lock:
            state._apply(state._validate(initial_state(cfg), allow_read_only=False))
        return state

    # ---- identity -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        dist = _dist()
        return dist.get_rank() if dist is not None else 0

    @property
    def lock(self) -> threading.RLock:
        """The state's re-entrant lock: hold it to make several reads/writes one atomic step boundary."""
        return self._lock

    @property
    def limits(self) -> RunLimits | None:
        return self._limits

    @property
    def version(self) -> int:
        """Bumped once for every key whose value actually changes (set, update, apply_staged)."""
        with self._lock:
            return self._version

    def _require_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(
                f"SharedState.{what} called on rank {self.rank}: only rank 0 mutates SharedState; "
                "other ranks receive rank 0's values through sync() at the step boundary")

    # ---- reads ----------------------------------------------------------------------------------
    def get(self, key: str) -> Any:
        """The current value of a declared key; an unknown key raises UnknownStateKeyError."""
        if key not in STATE_KEYS:
            raise UnknownStateKeyError(_unknown_key_message(key))
        with self._lock:
            return self._values[key]

    __getitem__ = get

    def __contains__(self, key: object) -> bool:
        return key in STATE_KEYS

    def keys(self) -> list[str]:
        return list(STATE_KEYS)

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of all values."""
        with self._lock:
            return dict(self._values)

    @staticmethod
    def schema() -> dict[str, dict]:
        """key -> {type, default, range, range_text, choices, hot, nullable, description, config_key}."""
        return {k: d.schema() for k, d in STATE_KEYS.items()}

    def staged(self) -> list[dict]:
        """The queued, not yet applied updates (copies)."""
        with self._lock:
            return [dict(s) for s in self._staged]

    # ---- validation -----------------------------------------------------------------------------
    def _validate(self, updates: dict, *, allow_read_only: bool, base: dict | None = None) -> dict[str, Any]:
        """Check each key, then the run's limits on ``base`` (default: current values) with ``updates`` applied."""
        if not isinstance(updates, dict):
            raise TypeError(f"updates must be a dict of key -> value, got {type(updates).__name__}")
        errors: dict[str, str] = {}
        clean: dict[str, Any] = {}
        for key, value in updates.items():
            decl = STATE_KEYS.get(key)
            if decl is None:
                errors[str(key)] = _unknown_key_message(key)
                continue
            if not allow_read_only and not decl.hot:
                errors[key] = (f"read-only at run time (only the trainer writes it); hot-updatable keys: "
                               f"{list(HOT_KEYS)}")
                continue
            norm, why = decl.check(value)
            if why is not None:
                errors[key] = why
            else:
                clean[key] = norm
        if self._limits is not None and clean:
            with self._lock:
                after = {**(self._values if base is None else base), **clean}
            errors.update(self._limits.check(after, clean))
        if errors:
            raise StateValidationError(errors)
        return clean

    # ---- writes (rank 0) --------------------------------------------------------------------------
    def _apply(self, clean: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        changed = []
        for key, new in clean.items():
            old = self._values[key]
            self._values[key] = new
            if old != new or type(old) is not type(new):
                self._version += 1
            changed.append((key, old, new))
        return changed

    def set(self, key: str, value: Any) -> None:
        """Trainer write of any key (read-only ones included); validated; rank 0 only."""
        self.update({key: value})

    def update(self, updates: dict[str, Any]) -> None:
        """``set`` for several keys at once: all are validated before any is applied."""
        self._require_rank0("set/update")
        with self._lock:
            self._apply(self._validate(updates, allow_read_only=True))

    def stage(self, updates: dict[str, Any], client: str = "") -> dict:
        """Validate hot updates and queue them, all or nothing, for the next step boundary (any thread, rank 0)."""
        self._require_rank0("stage")
        with self._lock:  # limits apply to the values as they will be once the queue is applied
            pending = {**self._values, **{item["key"]: item["value"] for item in self._staged}}
            clean = self._validate(updates, allow_read_only=False, base=pending)
            now, applies_at = time.time(), self._values["global_step"] + 1
            items = [{"key": key, "value": value, "client": str(client), "staged_at": now, "id": uuid.uuid4().hex}
                     for key, value in clean.items()]
            if self.on_stage is not None and items:
                self.on_stage([dict(i) for i in items], applies_at)  # raises: nothing is queued
            self._staged.extend(items)
            return {"staged": clean, "applies_at_step": applies_at}

    def apply_staged(self) -> list[dict]:
        """Apply the queued updates in order (rank 0; [] elsewhere); one audit record per update."""
        if self.rank != 0:
            return []
        with self._lock:
            queue, self._staged = self._staged, []
            records = []
            for item in queue:
                ((key, old, new),) = self._apply({item["key"]: item["value"]})
                records.append({"key": key, "old": old, "new": new, "client": item["client"],
                                "staged_at": item["staged_at"], "id": item["id"]})
            return records

    # ---- distribution ---------------------------------------------------------------------------
    def sync(self, group=None) -> None:
        """Collective: every rank takes rank 0's values and version; a no-op without a process group."""
        dist = _dist()
        if dist is None or dist.get_world_size(group) == 1:
            return
        src = 0 if group is None else dist.get_global_rank(group, 0)
        payload = [self.state_dict() if dist.get_rank() == src else None]
        dist.broadcast_object_list(payload, src=src, group=group)
        if dist.get_rank() != src:
            self.load_state_dict(payload[0])

    # ---- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"format", "version", "values"}; staged updates are not included (apply them first)."""
        with self._lock:
            return {"format": _FORMAT, "version": self._version, "values": dict(self._values)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore values and version; missing keys keep their defaults (older checkpoints), bad ones change nothing."""
        if not isinstance(sd, dict) or "values" not in sd:
            raise ValueError(f"SharedState.load_state_dict expects a dict with 'values' (from state_dict()); "
                             f"got {type(sd).__name__} with keys {list(sd) if isinstance(sd, dict) else None}")
        defaults = {k: d.default for k, d in STATE_KEYS.items()}
        clean = self._validate(dict(sd["values"]), allow_read_only=True, base=defaults)
        version = sd.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"SharedState.load_state_dict: 'version' must be an int >= 0, got {version!r}")
        with self._lock:
            self._values = {**defaults, **clean}
            self._version = version

    def save(self, path: str | os.PathLike) -> str:
        """Write ``state_dict()`` as JSON atomically (temp file, fsync, rename); returns the path."""
        from verl_ds.checkpoint_manifest import fsync_write

        path = os.path.abspath(os.fspath(path))
        fsync_write(path, (json.dumps(self.state_dict(), indent=1, sort_keys=True) + "\n").encode())
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Restore from a ``save`` file, a checkpoint's ``trainer_state.json`` or its ``global_step_<N>`` directory."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "trainer_state.json")
        expected = ('expected a SharedState snapshot {"format": 1, "version": <int>, "values": {<key>: <value>}} '
                    "(SharedState.save) or a checkpoint's trainer_state.json holding one under \"shared_state\"")
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SnapshotError(f"SharedState.load: {path}: {type(exc).__name__}: {exc}; {expected}") from None
        sd = raw.get("shared_state", raw) if isinstance(raw, dict) else raw
        if not isinstance(sd, dict) or not isinstance(sd.get("values"), dict):
            found = f"an object with keys {sorted(sd)[:8]}" if isinstance(sd, dict) else type(sd).__name__
            raise SnapshotError(f"SharedState.load: {path} holds {found}; {expected}")
        if sd.get("format", _FORMAT) != _FORMAT:
            raise SnapshotError(f"SharedState.load: {path} is snapshot format {sd.get('format')!r}; this version "
                                f"reads format {_FORMAT}")
        try:
            self.load_state_dict(sd)
        except ValueError as exc:  # StateValidationError included: a value out of range, an unknown key
            raise SnapshotError(f"SharedState.load: {path}: {exc}") from None

    def __repr__(self) -> str:
        return f"SharedState(rank={self.rank}, version={self.version}, values={self.snapshot()})"
