"""The DeepSpeed JSON entries the job config decides, and the user's ``deepspeed.config_file`` overlaid on them.

Both the start-up check (``check_deepspeed_file``) and the engines' JSON (``verl_ds.engines.ds_config``) use these
rules, so a file the check passes is the file the engines merge; the config never imports the engines.
"""
from __future__ import annotations

import json
import math
from typing import Optional

from .fields import ConfigError, show
from .loader import read_text_file

DERIVED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def derived_entries(cfg, derived, train: bool) -> dict:
    """The batch sizes (from the job config and world size, never patched later) and the precision
    (``model.dtype``) of a DeepSpeed JSON; ``train``: an engine with an optimizer (actor, critic)."""
    accum = derived.grad_accum if train else 1
    return {"train_micro_batch_size_per_gpu": cfg.actor.micro_batch_size, "gradient_accumulation_steps": accum,
            "train_batch_size": cfg.actor.micro_batch_size * accum * derived.world_size,
            "bf16": {"enabled": cfg.model.dtype == "bf16"}}


def merge_user_ds_config(generated: dict, path: str, user: Optional[dict] = None) -> dict:
    """Overlay a user DeepSpeed JSON onto the generated one; batch-size keys stay derived from the job config."""
    if user is None:
        with open(path, encoding="utf-8") as fh:
            user = json.load(fh)
    if not isinstance(user, dict):
        raise ValueError(f"deepspeed.config_file {path!r}: expected a JSON object, got {type(user).__name__}")
    for key in DERIVED_KEYS:
        if key in user and user[key] != "auto" and user[key] != generated[key]:
            raise ValueError(f"deepspeed.config_file {path!r}: {key}={user[key]} conflicts with the value derived from the job "
                             f"config ({generated[key]}); remove it or set it to \"auto\" and size batches with rollout/actor keys")
    if "optimizer" in user:
        raise ValueError(f"deepspeed.config_file {path!r}: drop the 'optimizer' section; verl_ds passes a torch AdamW "
                         "(lr from actor.lr / critic.lr) so no fused optimizer is JIT-compiled")
    _check_user_entries(user, generated, path)
    merged = dict(generated)
    for key, value in user.items():
        if key in DERIVED_KEYS:
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _enabled(section) -> bool:
    return isinstance(section, dict) and section.get("enabled") not in (None, False, "auto")


def _check_user_entries(user: dict, generated: dict, path: str) -> None:
    """Entries DeepSpeed would only reject (or crash on) deep inside engine construction: the ZeRO stage and
    the precision, which model.dtype decides (the model is built in that dtype before DeepSpeed sees it)."""
    where = f"deepspeed.config_file {path!r}"
    zero = user.get("zero_optimization")
    if zero is not None:
        if not isinstance(zero, dict):
            raise ValueError(f"{where}: zero_optimization must be a JSON object, got {json.dumps(zero)[:80]}")
        stage = zero.get("stage")
        if "stage" in zero and (isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3):
            raise ValueError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)[:80]}; "
                             "or drop it (deepspeed.zero_stage sets it)")
    if _enabled(user.get("fp16")):
        raise ValueError(f"{where}: fp16.enabled is not supported: the engines' precision comes from model.dtype "
                         "(fp32 or bf16); drop the fp16 section and set model.dtype")
    if "bf16" in user and _enabled(user["bf16"]) != generated["bf16"]["enabled"]:
        raise ValueError(f"{where}: bf16 {json.dumps(user['bf16'])[:80]} contradicts model.dtype (the engines' "
                         f"precision: bf16.enabled={str(generated['bf16']['enabled']).lower()}); drop the bf16 "
                         "section and set model.dtype")


def _non_finite(data, where: str = "") -> tuple[str, float] | None:
    """(dotted key, value) of the first NaN or infinity in a JSON value, or None."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        name = f"{where}.{key}" if where and isinstance(key, str) else f"{where}[{key}]" if where else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
        found = _non_finite(value, name)
        if found is not None:
            return found
    return None


def check_deepspeed_file(cfg, derived) -> None:
    """ConfigError naming ``deepspeed.config_file`` when the file is unreadable, not a JSON object, holds a
    non-finite number, or cannot be merged into an engine's JSON (checked for the trained and the frozen roles)."""
    path = cfg.deepspeed.config_file
    if path is None:
        return
    text = read_text_file(path, "deepspeed.config_file:")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"deepspeed.config_file: {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed.config_file: {path!r} must hold a JSON object, got a JSON {type(data).__name__}")
    try:
        bad = _non_finite(data)
    except RecursionError:
        raise ConfigError(f"deepspeed.config_file: {path!r} is nested too deeply") from None
    if bad is not None:  # Python's json reads NaN and Infinity; DeepSpeed would clip (or scale) by them
        raise ConfigError(f"deepspeed.config_file: {path!r}: {bad[0]} is {bad[1]!r}; expected a finite number")
    clip = data.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"deepspeed.config_file: {path!r}: gradient_clipping is {show(clip)}; expected a number "
                          ">= 0 (0 disables)")
    for train in (True, False):  # actor and critic, then the reference: refused here, not mid-build
        try:
            merge_user_ds_config(derived_entries(cfg, derived, train), path, data)
        except ValueError as exc:
            raise ConfigError(str(exc).replace("deepspeed.config_file ", "deepspeed.config_file: ", 1)) from None
