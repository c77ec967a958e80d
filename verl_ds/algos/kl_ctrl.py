"""KL coefficient controllers (peers.md 2.5), one interface: ``.value``, ``.update(current_kl, n_samples)``,
``state_dict()``, ``load_state_dict()``.

``current_kl`` is the observed KL in the units of ``target_kl`` (verl: per-token nats, the mean over the
batch of each sequence's masked mean); ``n_samples`` is the global number of samples since the last
update (summed over data-parallel ranks, or the controller moves dp_size times too slowly).
"""
from __future__ import annotations

import math
import numbers

import torch

KL_CTRL_KINDS = ("fixed", "adaptive", "multiplicative")
_CTRL_ALIASES = {"ziegler": "adaptive", "proportional": "adaptive", "bangbang": "multiplicative", "constant": "fixed"}


def _number(value, name: str, *, positive: bool = False, allow_zero: bool = False) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not (value > 0 or (allow_zero and value == 0)):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def _n_samples(n_samples) -> int:
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int (the global number of samples since the last "
                         f"update), got {n_samples!r}")
    return int(n_samples)


class _KLController:
    kind = ""
    _fields: tuple = ()

    def __init__(self, value: float):
        self.value = value

    def update(self, current_kl, n_samples=None) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything needed to resume: the kind, the current coefficient and the settings."""
        return {"kind": self.kind, "value": self.value, **{f: getattr(self, f) for f in self._fields}}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; a state from another controller kind is an error."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        if state.get("kind") != self.kind:
            raise ValueError(f"state is for a {state.get('kind')!r} KL controller, this one is {self.kind!r}")
        missing = [k for k in ("value", *self._fields) if k not in state]
        if missing:
            raise ValueError(f"state for the {self.kind!r} KL controller lacks {', '.join(missing)}")
        self.value = _number(state["value"], "value", positive=True, allow_zero=True)
        for f in self._fields:
            setattr(self, f, state[f])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items() if k != "kind")
        return f"{type(self).__name__}({args})"


class FixedKLController(_KLController):
    """A constant coefficient; ``update`` checks its input and changes nothing."""

    kind = "fixed"

    def __init__(self, kl_coef: float):
        super().__init__(_number(kl_coef, "kl_coef", positive=True, allow_zero=True))

    def update(self, current_kl, n_samples=None) -> float:
        _number(current_kl, "current_kl")
        if n_samples is not None:
            _n_samples(n_samples)
        return self.value


class AdaptiveKLController(_KLController):
    """Ziegler et al. 2019 (arXiv:1909.08593) proportional controller, as in verl/OpenRLHF/TRL:
    e = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + e * n_samples / horizon."""

    kind = "adaptive"
    _fields = ("target_kl", "horizon")

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int = 10000):
        super().__init__(_number(init_kl_coef, "init_kl_coef", positive=True, allow_zero=True))
        self.target_kl = _number(target_kl, "target_kl", positive=True)
        if isinstance(horizon, bool) or not isinstance(horizon, numbers.Real) or not horizon > 0:
            raise ValueError(f"horizon must be a positive number of samples, got {horizon!r}")
        self.horizon = horizon

    def update(self, current_kl, n_samples=None) -> float:
        kl = _number(current_kl, "current_kl")
        if n_samples is None:
            raise ValueError("AdaptiveKLController.update needs n_samples (the global number of samples "
                             "since the last update)")
        n = _n_samples(n_samples)
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon
        return self.value


class MultiplicativeKLController(_KLController):
    """The design's rule: after each update, KL > 1.5 * target: coef *= up; KL < 0.5 * target:
    coef *= down; otherwise unchanged; the result clamped to [min_coef, max_coef]."""

    kind = "multiplicative"
    _fields = ("target_kl", "up", "down", "min_coef", "max_coef")

    def __init__(self, init_kl_coef: float, target_kl: float, up: float = 1.5, down: float = 0.8,
                 min_coef: float = 0.0, max_coef: float = math.inf):
        self.target_kl = _number(target_kl, "target_kl", positive=True)
        self.up = _number(up, "up", positive=True)
        self.down = _number(down, "down", positive=True)
        if self.up < 1.0:
            raise ValueError(f"up must be >= 1 (the factor applied when KL is too high), got {up!r}")
        if self.down > 1.0:
            raise ValueError(f"down must be in (0, 1] (the factor applied when KL is too low), got {down!r}")
        self.min_coef = _number(min_coef, "min_coef", positive=True, allow_zero=True)
        if isinstance(max_coef, bool) or not isinstance(max_coef, numbers.Real) or math.isnan(max_coef):
            raise TypeError(f"max_coef must be a real number, got {max_coef!r}")
        self.max_coef = float(max_coef)
        if self.max_coef < self.min_coef:
            raise ValueError(f"max_coef ({max_coef!r}) must be >= min_coef ({min_coef!r})")
        init = _number(init_kl_coef, "init_kl_coef", positive=True, allow_zero=True)
        if not self.min_coef <= init <= self.max_coef:
            raise ValueError(f"init_kl_coef must be in [min_coef, max_coef] = [{self.min_coef}, {self.max_coef}], "
                             f"got {init!r}")
        super().__init__(init)

    def update(self, current_kl, n_samples=None) -> float:
        kl = _number(current_kl, "current_kl")
        if n_samples is not None:
            _n_samples(n_samples)
        if kl > 1.5 * self.target_kl:
            self.value *= self.up
        elif kl < 0.5 * self.target_kl:
            self.value *= self.down
        self.value = min(max(self.value, self.min_coef), self.max_coef)
        return self.value


def make_kl_controller(kind: str, init_kl_coef: float, target_kl: float | None = None, horizon: int = 10000,
                       **kwargs) -> _KLController:
    """Build a controller by name: "fixed", "adaptive" (Ziegler; alias "ziegler") or "multiplicative"
    (the design's 1.5/0.8 rule; alias "bangbang"). Extra keywords go to the multiplicative controller
    (up, down, min_coef, max_coef)."""
    if not isinstance(kind, str) or _CTRL_ALIASES.get(kind, kind) not in KL_CTRL_KINDS:
        valid = ", ".join(KL_CTRL_KINDS + tuple(_CTRL_ALIASES))
        raise ValueError(f"unknown KL controller kind {kind!r}; valid kinds: {valid}")
    kind = _CTRL_ALIASES.get(kind, kind)
    if kind == "multiplicative":
        if target_kl is None:
            raise ValueError("the multiplicative KL controller needs target_kl")
        return MultiplicativeKLController(init_kl_coef, target_kl, **kwargs)
    if kwargs:
        raise TypeError(f"unexpected arguments for the {kind!r} KL controller: {', '.join(sorted(kwargs))}")
    if kind == "adaptive":
        if target_kl is None:
            raise ValueError("the adaptive KL controller needs target_kl")
        return AdaptiveKLController(init_kl_coef, target_kl, horizon)
    return FixedKLController(init_kl_coef)
