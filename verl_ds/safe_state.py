"""Checkpoint state that loads without running code (a pickle in a writable directory would run code in the job):
plain JSON, with tuples, tensors and arrays as one-key objects (``{"__tuple__": [...]}``, ``{"__tensor__": "t0"}``)
whose tensors live in ``<name>.safetensors``; floats round-trip bit for bit. Older pickles load through torch's
restricted unpickler. Trust model: docs/reliability.md."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
import torch

_TAGS = ("__tuple__", "__tensor__", "__ndarray__", "__dict__")


class UnsafeStateError(ValueError):
    """A state file that cannot be read as data only (it holds code or objects of other types)."""


def _encode(obj: Any, tensors: dict, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: dict keys must be strings to be saved as JSON, got {bad[0]!r}")
        out = {k: _encode(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        return {"__dict__": out} if len(out) == 1 and next(iter(out)) in _TAGS else out
    raise TypeError(f"{where}: a value of type {type(obj).__name__} cannot be saved as data (JSON or a tensor); "
                    "give the state_dict plain values")


def _decode(obj: Any, tensors: dict) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        tag, value = next(iter(obj.items()))
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in value)
        if tag == "__tensor__":
            return tensors[value]
        if tag == "__ndarray__":
            return tensors[value].numpy()
        if tag == "__dict__":
            return {k: _decode(v, tensors) for k, v in value.items()}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def encode(obj: Any) -> tuple[bytes, dict]:
    """(the JSON bytes, the tensors by key) of ``obj``; TypeError naming what cannot be stored as data."""
    tensors: dict = {}
    text = json.dumps(_encode(obj, tensors, "state"), indent=1, sort_keys=True)
    return text.encode(), tensors


def dump(obj: Any, json_path: str, write) -> list[str]:
    """Write ``obj`` to ``json_path`` and its tensors beside it with ``write(path, bytes)``; returns the paths."""
    from safetensors.torch import save

    data, tensors = encode(obj)
    paths = []
    if tensors:
        st_path = os.path.splitext(json_path)[0] + ".safetensors"
        write(st_path, save(tensors))
        paths.append(st_path)
    write(json_path, data)
    return paths + [json_path]


def load(json_path: str) -> Any:
    """The object ``dump`` wrote; reads JSON and safetensors only (no code runs)."""
    from safetensors.torch import load_file

    with open(json_path, encoding="utf-8") as fh:
        raw = json.load(fh)
    st_path = os.path.splitext(json_path)[0] + ".safetensors"
    tensors = load_file(st_path) if os.path.isfile(st_path) else {}
    return _decode(raw, tensors)


def load_legacy_pickle(path: str) -> Any:
    """An older verl_ds's pickled state, read with torch's restricted unpickler (``weights_only=True``);
    UnsafeStateError when it asks for anything else."""
    try:  # numpy >= 2 names it numpy._core (the name its pickles use)
        from numpy._core.multiarray import _reconstruct
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    allowed = [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler's refusal (UnpicklingError) and broken files alike
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # torch's own advice (load with weights_only=False) is exactly what must not be done with such a file
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0] if lines else "")
        raise UnsafeStateError(f"{path} cannot be read as data only ({type(exc).__name__}: {why[:300]})") from None


def find_legacy(step_dir: str, name: str) -> Optional[str]:
    """``<step_dir>/<name>.pt`` when an older version wrote it, else None."""
    path = os.path.join(step_dir, f"{name}.pt")
    return path if os.path.isfile(path) else None
