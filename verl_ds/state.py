"""SharedState: the cross-model hyper-parameters of a PPO run, owned by rank 0.

Every key is declared (:class:`StateKey`: name, type, default, allowed range or choices, hot-updatable
or not, one-line description). Rank 0 is the only writer; at every step boundary the trainer calls
``apply_staged()`` (rank 0 applies the hot updates queued by the HTTP thread) and then ``sync()``,
which broadcasts rank 0's values to every rank, so all ranks train with identical hyper-parameters.

Typical step boundary (all ranks)::

    changes = state.apply_staged()   # rank 0 applies the queue; [] on other ranks
    state.sync()                     # collective: every rank gets rank 0's values and version

All reads and writes hold one ``threading.RLock``. Values are plain python scalars (bool, int, float,
str, or None for nullable keys), so ``snapshot()`` and ``save()`` are JSON as they are.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from verl_ds.algos import KL_KINDS

__all__ = ["StateKey", "SharedState", "StateValidationError", "UnknownStateKeyError", "STATE_KEYS", "HOT_KEYS"]

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str"}
_FORMAT = 1  # version of the state_dict / JSON layout


@dataclass(frozen=True)
class StateKey:
    """Declaration of one SharedState key.

    range: (low, high) bounds for int/float keys, either may be None (unbounded); both inclusive
    unless ``low_open`` (then low < value) or ``high_open`` (value < high). choices: the allowed values of a str key.
    hot: True when it may be changed while training runs (through ``stage``); read-only keys are
    only written by the trainer (``set``). nullable: None is an allowed value (e.g. best_reward
    before any evaluation).
    """

    name: str
    type: type
    default: Any
    range: tuple[float | None, float | None] | None = None
    choices: tuple[Any, ...] | None = None
    hot: bool = False
    description: str = ""
    low_open: bool = False
    nullable: bool = False
    high_open: bool = False

    def range_text(self) -> str | None:
        if self.range is None:
            return None
        lo, hi = self.range
        left = "(" if (self.low_open or lo is None) else "["
        right = ")" if (self.high_open or hi is None) else "]"
        return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"

    def check(self, value: Any) -> tuple[Any, str | None]:
        """Return (normalised value, None) or (None, reason why the value is refused)."""
        if value is None:
            return (None, None) if self.nullable else (None, f"expected {_TYPE_NAMES[self.type]}, got None")
        got = type(value).__name__
        if self.type is bool:
            if not isinstance(value, bool):
                return None, f"expected bool (true/false), got {got} {value!r}"
        elif self.type is int:
            # bool is an int subclass in python; True as a top_k is a bug, not a 1
            if isinstance(value, bool) or not isinstance(value, int):
                return None, f"expected int, got {got} {value!r}"
            value = int(value)
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None, f"expected float, got {got} {value!r}"
            value = float(value)
            if not math.isfinite(value):
                return None, f"expected a finite float, got {value!r}"
        elif self.type is str:
            if not isinstance(value, str):
                return None, f"expected str, got {got} {value!r}"
        if self.choices is not None and value not in self.choices:
            return None, f"{value!r} is not one of {list(self.choices)}"
        if self.range is not None:
            lo, hi = self.range
            below = lo is not None and (value <= lo if self.low_open else value < lo)
            above = hi is not None and (value >= hi if self.high_open else value > hi)
            if below or above:
                return None, f"{value!r} is out of range {self.range_text()}"
        return value, None

    def schema(self) -> dict:
        return {
            "type": _TYPE_NAMES[self.type],
            "default": self.default,
            "range": None if self.range is None else list(self.range),
            "range_text": self.range_text(),  # "(0.0, 100.0]": parentheses mark open bounds
            "choices": None if self.choices is None else list(self.choices),
            "hot": self.hot,
            "nullable": self.nullable,
            "description": self.description,
        }


def _k(name, typ, default, description, *, range=None, choices=None, hot=False, low_open=False, nullable=False,
       high_open=False):
    return StateKey(name, typ, default, range, choices, hot, description, low_open, nullable, high_open)


# Defaults follow verl's PPO config where it has one (kl_coef 0.001, target_kl 0.1, clip 0.2,
# cliprange_value 0.5, gamma 1.0) and TRL's otherwise (lam 0.95). Sampling defaults are the
# unbiased ones (top_k=0, top_p=1.0): truncation makes the rollout distribution differ from the one
# the trainer scores (peers.md §3, TRL #6789). The trainer `set`s all of them from its config at start.
STATE_KEYS: dict[str, StateKey] = {k.name: k for k in [
    # --- hot-updatable (17) ---
    _k("actor_lr", float, 1e-6, "actor optimizer learning rate", range=(0.0, 1.0), hot=True),
    _k("critic_lr", float, 1e-5, "critic optimizer learning rate", range=(0.0, 1.0), hot=True),
    _k("kl_coef", float, 0.001, "KL penalty coefficient beta (the KL controller writes it after each update)",
       range=(0.0, 1e3), hot=True),
    _k("target_kl", float, 0.1, "KL target of the adaptive/multiplicative controllers, nats per token",
       range=(0.0, 1e3), low_open=True, hot=True),
    _k("kl_ctrl_type", str, "fixed", "KL controller: fixed, adaptive (Ziegler et al.) or multiplicative (x1.5/x0.8)",
       choices=("fixed", "adaptive", "multiplicative"), hot=True),
    _k("use_kl_penalty", bool, True, "apply the KL penalty (in the reward or in the loss, per PPOConfig.kl_in_reward)",
       hot=True),
    _k("kl_kind", str, "k1", "per-token KL estimator", choices=tuple(KL_KINDS), hot=True),
    _k("clip_ratio_low", float, 0.2, "PPO ratio clip below 1 (epsilon_low)", range=(0.0, 1.0), high_open=True,
       hot=True),
    _k("clip_ratio_high", float, 0.2, "PPO ratio clip above 1 (epsilon_high)", range=(0.0, 10.0), hot=True),
    _k("cliprange_value", float, 0.5, "value-loss clip range around the old values", range=(0.0, 1e6), hot=True),
    _k("entropy_coef", float, 0.0, "entropy bonus coefficient", range=(0.0, 1.0), hot=True),
    _k("gamma", float, 1.0, "GAE discount", range=(0.0, 1.0), hot=True),
    _k("lam", float, 0.95, "GAE lambda", range=(0.0, 1.0), hot=True),
    _k("temperature", float, 1.0, "sampling temperature (also used to score log-probs)", range=(0.0, 100.0),
       low_open=True, hot=True),
    _k("top_k", int, 0, "top-k sampling; 0 disables", range=(0, None), hot=True),
    _k("top_p", float, 1.0, "nucleus sampling; 1.0 disables", range=(0.0, 1.0), low_open=True, hot=True),
    _k("max_new_tokens", int, 128, "maximum response length in tokens", range=(1, 1 << 20), hot=True),
    # --- read-only at run time (written by the trainer only) ---
    _k("global_step", int, 0, "optimizer steps completed", range=(0, None)),
    _k("epoch", int, 0, "passes over the prompt data completed", range=(0, None)),
    _k("actor_version", int, 0, "bumped whenever the actor weights change", range=(0, None)),
    _k("reward_version", int, 0, "bumped whenever the reward model/functions are swapped", range=(0, None)),
    _k("best_reward", float, None, "best mean reward seen so far (None before the first)", nullable=True),
    _k("reward_name", str, "", "name of the active reward (model or function set)"),
]}
HOT_KEYS: tuple[str, ...] = tuple(k for k, d in STATE_KEYS.items() if d.hot)
assert len(HOT_KEYS) == 17, HOT_KEYS


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


def _unknown_key_message(key: Any) -> str:
    close = difflib.get_close_matches(str(key), list(STATE_KEYS), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown SharedState key {key!r}{hint} Valid keys: {sorted(STATE_KEYS)}"


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class SharedState:
    """Rank-0-owned, thread-safe store of the declared keys (see module docstring).

    rank: this process's rank; None reads ``torch.distributed.get_rank()`` at every call when the
    process group is initialised (so a state built before ``init_process_group`` is still right),
    else 0. Only rank 0 may ``set``/``update``/``stage``/``apply_staged``.
    """

    def __init__(self, rank: int | None = None):
        self._rank = rank
        self._lock = threading.RLock()
        self._values: dict[str, Any] = {k: d.default for k, d in STATE_KEYS.items()}
        self._version = 0
        self._staged: list[dict] = []

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
        """key -> {type, default, range, range_text, choices, hot, nullable, description}."""
        return {k: d.schema() for k, d in STATE_KEYS.items()}

    def staged(self) -> list[dict]:
        """The queued, not yet applied updates (copies)."""
        with self._lock:
            return [dict(s) for s in self._staged]

    # ---- validation -----------------------------------------------------------------------------
    @staticmethod
    def _validate(updates: dict, *, allow_read_only: bool) -> dict[str, Any]:
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
        clean = self._validate(updates, allow_read_only=True)
        with self._lock:
            self._apply(clean)

    def stage(self, updates: dict[str, Any], client: str = "") -> dict:
        """Validate hot updates and queue them for the next step boundary (any thread, rank 0).

        Every key is checked before anything is queued; on any failure one StateValidationError
        names every offending key and nothing is queued. Returns
        ``{"staged": {key: normalised value}, "applies_at_step": global_step + 1}``.
        """
        self._require_rank0("stage")
        clean = self._validate(updates, allow_read_only=False)
        now = time.time()
        with self._lock:
            for key, value in clean.items():
                self._staged.append({"key": key, "value": value, "client": str(client), "staged_at": now})
            return {"staged": clean, "applies_at_step": self._values["global_step"] + 1}

    def apply_staged(self) -> list[dict]:
        """Apply the queued updates in order (rank 0; a no-op returning [] on other ranks).

        Returns one audit record per applied update: {"key", "old", "new", "client", "staged_at"}.
        """
        if self.rank != 0:
            return []
        with self._lock:
            queue, self._staged = self._staged, []
            records = []
            for item in queue:
                ((key, old, new),) = self._apply({item["key"]: item["value"]})
                records.append({"key": key, "old": old, "new": new, "client": item["client"],
                                "staged_at": item["staged_at"]})
            return records

    # ---- distribution ---------------------------------------------------------------------------
    def sync(self, group=None) -> None:
        """Collective: every rank takes rank 0's values and version. No-op without a process group.

        Uses ``torch.distributed.broadcast_object_list`` (works on gloo and nccl). Staged updates
        stay on rank 0.
        """
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
        """Restore values and version (any rank: every rank may load the same checkpoint).

        Keys missing from ``sd`` keep their defaults (checkpoints from older versions); unknown keys
        or invalid values raise StateValidationError and leave the state unchanged.
        """
        if not isinstance(sd, dict) or "values" not in sd:
            raise ValueError(f"SharedState.load_state_dict expects a dict with 'values' (from state_dict()); "
                             f"got {type(sd).__name__} with keys {list(sd) if isinstance(sd, dict) else None}")
        clean = self._validate(dict(sd["values"]), allow_read_only=True)
        version = sd.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"SharedState.load_state_dict: 'version' must be an int >= 0, got {version!r}")
        with self._lock:
            self._values = {k: d.default for k, d in STATE_KEYS.items()}
            self._values.update(clean)
            self._version = version

    def save(self, path: str | os.PathLike) -> None:
        """Atomic JSON: write a temp file in the same folder, fsync, then os.replace over ``path``."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        data = json.dumps(self.state_dict(), indent=2, sort_keys=True, allow_nan=False)
        fd, tmp = tempfile.mkstemp(prefix=".shared_state.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Load a file written by ``save`` (validated like ``load_state_dict``)."""
        with open(path) as f:
            try:
                sd = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"SharedState.load: {os.fspath(path)!r} is not valid JSON: {e}") from None
        self.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"SharedState(rank={self.rank}, version={self.version}, values={self.snapshot()})"
