"""Input checks shared by the numerics: each failure names the argument, what was expected and what was got."""
from __future__ import annotations

import math
import numbers

import torch

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float_tensor(x, name: str) -> torch.Tensor:
    check_tensor(x, name)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32/float64/bfloat16/float16), got dtype {x.dtype}")
    return x


def check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {b_name} has shape {tuple(b.shape)} but {a_name} has shape "
                         f"{tuple(a.shape)}; they must be equal")


def check_positive_number(value, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def check_unit_interval(value, name: str) -> float:
    value = check_positive_number(value, name, allow_zero=True)
    if value > 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return value


def as_bool_mask(mask, name: str, shape: torch.Size, shape_of: str) -> torch.Tensor:
    """``mask`` as a bool tensor of ``shape``; float/int masks must hold only 0 and 1."""
    check_tensor(mask, name)
    if mask.shape != shape:
        raise ValueError(f"shape mismatch: {name} has shape {tuple(mask.shape)} but {shape_of} has shape "
                         f"{tuple(shape)}; they must be equal")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool (or 0/1 integer/float) tensor, got dtype {mask.dtype}")
    # One device sync; a mask of 0.5s or -1s is a caller bug that would otherwise weight tokens silently.
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        example = mask[bad].flatten()[0].item()
        raise ValueError(f"{name} must hold only 0 and 1 (or be a bool tensor), got a value {example!r} "
                         f"(dtype {mask.dtype})")
    return mask != 0
