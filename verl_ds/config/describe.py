"""The key reference: a markdown table generated from the fields (docs/config.md is its output)."""
from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Optional

from .fields import choices_of, type_name
from .schema import default_of, iter_fields


def _allowed(tp, spec) -> str:
    choices = choices_of(tp, spec)
    if choices is not None:
        shown = tuple(spec.config_only) + tuple(choices)
        text = ", ".join(f"`{c}`" for c in shown)
        return text
    text = spec.range_text()
    return f"`{text}`" if text else ""


def describe(registry_choices: Optional[Mapping[str, tuple]] = None) -> str:
    """Markdown table of every key: type, default, allowed values, SharedState name when hot-updatable, help.
    ``registry_choices``: key -> the names its registry holds (``verl_ds.resolved_config.registry_choices()``)."""
    lines = ["| key | type | default | allowed | hot | help |", "|---|---|---|---|---|---|"]
    for dotted, tp, spec, f in iter_fields():
        if registry_choices and dotted in registry_choices:
            spec = dataclasses.replace(spec, choices=tuple(registry_choices[dotted]))
        default = default_of(f)
        hot = f"`{spec.hot}`" if spec.hot else ""
        name = "str" if choices_of(tp, spec) is not None else type_name(tp)
        if spec.items is not None:
            name = f"list of {type_name(spec.items)}"
        lines.append(f"| `{dotted}` | {name} | `{json.dumps(default)}` | {_allowed(tp, spec)} | {hot} | {spec.help} |")
    return "\n".join(lines)
