"""Prometheus text exposition (format 0.0.4) of the training metrics and the SharedState, for ``GET /metrics``."""
from __future__ import annotations

import math
import re
from typing import Any

from verl_ds.state import STATE_KEYS

__all__ = ["prometheus_text"]

_PROM_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _prom_name(key: str, prefix: str) -> str:
    name = _PROM_BAD.sub("_", str(key))
    return re.sub(r"_+", "_", f"{prefix}_{name}").rstrip("_")


def _prom_value(v: Any) -> str | None:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    # numpy / torch scalars
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", 0) == 0:
        try:
            return _prom_value(item())
        except Exception:  # noqa: BLE001 - an odd object is skipped, not a 500
            return None
    return None


def _prom_label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def prometheus_text(metrics: dict, state: dict, state_version: int | None = None) -> str:
    """Prometheus text (format 0.0.4): numeric metrics as gauges ``verl_ds_<key>`` (the first key wins a name
    collision after sanitising), numeric SharedState keys as ``verl_ds_state_<key>``, str keys as labels of
    ``verl_ds_state_info``."""
    lines: list[str] = []
    seen: set[str] = set()

    def gauge(name: str, value: str, help_text: str) -> None:
        if name in seen:
            return
        seen.add(name)
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"])

    for key in sorted(metrics, key=str):
        value = _prom_value(metrics[key])
        if value is not None:
            gauge(_prom_name(key, "verl_ds"), value, f"training metric {_prom_label(key)}")
    info = {}
    for key in sorted(state):
        value = state[key]
        if isinstance(value, str):
            info[key] = value
            continue
        text = _prom_value(value)
        if text is not None:
            desc = STATE_KEYS[key].description if key in STATE_KEYS else "SharedState value"
            gauge(_prom_name(key, "verl_ds_state"), text, f"SharedState {key}: {_prom_label(desc)}")
    if info:
        labels = ",".join(f'{_PROM_BAD.sub("_", k)}="{_prom_label(v)}"' for k, v in sorted(info.items()))
        gauge("verl_ds_state_info{" + labels + "}", "1", "SharedState string values as labels")
    if state_version is not None:
        gauge("verl_ds_shared_state_version", str(int(state_version)), "SharedState version (bumped per change)")
    return "\n".join(lines) + "\n"
