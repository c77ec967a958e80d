"""KL coefficient controllers (fixed, band, ziegler), built by name (:func:`make_kl_controller`). ``current_kl`` is
the token mean of the per-token KL over every rank's response tokens (verl's mean of sequence means depends on the
split over ranks), and ``n_samples`` is global, or Ziegler's controller would move dp_size times too slowly.
"""
from __future__ import annotations

import inspect
import math
import numbers

import torch

from ._checks import as_bool_mask, check_float_tensor
from .registry import Registry

KL_CONTROLLERS = Registry("KL controller kind", "kinds")
KL_CTRL_KINDS = KL_CONTROLLERS.view()  # fixed, band, ziegler


def register_kl_controller(name: str, *, aliases: tuple = ()):
    """Class decorator registering ``cls(init_kl_coef, target_kl, horizon, **kwargs)``; sets ``cls.name``."""
    def add(cls):
        KL_CONTROLLERS.register(name, aliases=aliases)(cls)
        cls.name = name
        return cls
    return add


def observed_kl(kl: torch.Tensor, response_mask: torch.Tensor):
    """This rank's share of the observed KL: (sum of ``kl`` (B, R) over the response tokens, their count), two
    0-d float64 tensors; the controller's input is sum / count after an all-reduce of both."""
    check_float_tensor(kl, "kl")
    m = as_bool_mask(response_mask, "response_mask", kl.shape, "kl")
    total = torch.where(m, kl.detach().to(torch.float64), torch.zeros((), dtype=torch.float64, device=kl.device))
    return total.sum(), m.sum().to(torch.float64)


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
    name = ""
    _fields: tuple = ()

    def __init__(self, value: float):
        self.value = value

    def update(self, current_kl, n_samples=None) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything needed to resume: the kind (the controller's name), the coefficient and the settings."""
        return {"kind": self.name, "value": self.value, **{f: getattr(self, f) for f in self._fields}}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; a state from another controller kind is an error."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        kind = state.get("kind")
        if kind != self.name:
            raise ValueError(f"state is for a {kind!r} KL controller, this one is {self.name!r}")
        missing = [k for k in ("value", *self._fields) if k not in state]
        if missing:
            raise ValueError(f"state for the {self.name!r} KL controller lacks {', '.join(missing)}")
        self.value = _number(state["value"], "value", positive=True, allow_zero=True)
        for f in self._fields:
            setattr(self, f, state[f])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items() if k != "kind")
        return f"{type(self).__name__}({args})"


@register_kl_controller("fixed")
class FixedKLController(_KLController):
    """A constant coefficient; ``update`` checks its input and changes nothing."""

    name = "fixed"

    def __init__(self, kl_coef: float, target_kl: float | None = None, horizon: int | None = None):
        super().__init__(_number(kl_coef, "kl_coef", positive=True, allow_zero=True))

    def update(self, current_kl, n_samples=None) -> float:
        _number(current_kl, "current_kl")
        if n_samples is not None:
            _n_samples(n_samples)
        return self.value


@register_kl_controller("ziegler")
class ZieglerKLController(_KLController):
    """Ziegler et al. 2019 (arXiv:1909.08593) proportional controller, as in verl/OpenRLHF/TRL:
    e = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + e * n_samples / horizon."""

    name = "ziegler"
    _fields = ("target_kl", "horizon")

    def __init__(self, init_kl_coef: float, target_kl: float | None, horizon: int = 10000):
        if target_kl is None:
            raise ValueError("the ziegler KL controller needs target_kl")
        super().__init__(_number(init_kl_coef, "init_kl_coef", positive=True, allow_zero=True))
        self.target_kl = _number(target_kl, "target_kl", positive=True)
        if isinstance(horizon, bool) or not isinstance(horizon, numbers.Real) or not horizon > 0:
            raise ValueError(f"horizon must be a positive number of samples, got {horizon!r}")
        self.horizon = horizon

    def update(self, current_kl, n_samples=None) -> float:
        kl = _number(current_kl, "current_kl")
        if n_samples is None:
            raise ValueError(f"{type(self).__name__}.update needs n_samples (the global number of samples "
                             "since the last update)")
        n = _n_samples(n_samples)
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon
        return self.value


@register_kl_controller("band")
class BandKLController(_KLController):
    """Keeps the KL inside a band around the target: after each update, KL > 1.5 * target:
    coef *= up; KL < 0.5 * target: coef *= down; otherwise unchanged; clamped to [min_coef, max_coef]."""

    name = "band"
    _fields = ("target_kl", "up", "down", "min_coef", "max_coef")

    def __init__(self, init_kl_coef: float, target_kl: float | None, horizon: int | None = None, *,
                 up: float = 1.5, down: float = 0.8, min_coef: float = 0.0, max_coef: float = math.inf):
        if target_kl is None:
            raise ValueError("the band KL controller needs target_kl")
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
    """A registered controller by name; extra keywords go to it (band: up, down, min_coef, max_coef)."""
    name = KL_CONTROLLERS.canonical(kind)
    cls = KL_CONTROLLERS.get(name)
    accepted = inspect.signature(cls).parameters
    unexpected = sorted(k for k in kwargs if k not in accepted or k in ("init_kl_coef", "target_kl", "horizon"))
    if unexpected:
        raise TypeError(f"unexpected arguments for the {name!r} KL controller: {', '.join(unexpected)}")
    return cls(init_kl_coef, target_kl, horizon, **kwargs)
