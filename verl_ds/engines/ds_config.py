"""The DeepSpeed JSON, generated from the job config by one pure function (unit-tested on CPU)."""
from __future__ import annotations

import json
from typing import Optional

from verl_ds.config import Config, Derived
from verl_ds.engines.cpu_speed import zero3_overrides


def uses_gpu(cfg: Config) -> bool:
    """Whether the engines run on CUDA (``trainer.device``; ``auto``: when a GPU is visible)."""
    if cfg.trainer.device == "auto":
        import torch

        return torch.cuda.is_available()
    return cfg.trainer.device == "cuda"


def make_ds_config(cfg: Config, derived: Derived, role: str, grad_clip: float = 0.0,
                   gpu: Optional[bool] = None) -> dict:
    """DeepSpeed config for ``role`` in {"actor", "critic", "ref"}; batch sizes are derived, never patched later.

    The reference (and a neural reward model) is an inference engine, no optimizer: ZeRO-3 when the actor is
    ZeRO-3, else stage 0 (unpartitioned), as DeepSpeed-Chat's ``_init_ref`` (microsoft/DeepSpeedExamples,
    ``dschat/rlhf/rlhf_engine.py``: below stage 3 every rank holds the actor's weights whole, so a frozen copy fits
    too, and ZeRO-3's per-module gather hooks cost the default tiny job's step 20%).
    The optimizer itself is passed to ``deepspeed.initialize`` (``engines.build.optimizer_name``): a torch
    AdamW on CPU runs (DeepSpeed's own "AdamW" type becomes FusedAdam and JIT-compiles for a minute on CPU),
    DeepSpeed's CPU Adam over pinned memory when the optimizer is offloaded from a GPU (``gpu``: None
    decides from ``trainer.device``).
    """
    ds = cfg.deepspeed
    gpu = uses_gpu(cfg) if gpu is None else gpu
    pin = bool(gpu)  # pinned host buffers speed up GPU<->CPU copies; on a CPU-only run they only cost
    train = role in ("actor", "critic")
    stage = ds.zero_stage if train else (3 if ds.zero_stage == 3 else 0)  # the reference: see above
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update({
            **zero3_overrides(gpu),  # CPU runs: torch's own linear (verl_ds.engines.cpu_speed)
            "stage3_max_live_parameters": ds.stage3_max_live_parameters,
            "stage3_max_reuse_distance": ds.stage3_max_reuse_distance,
            "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": ds.stage3_param_persistence_threshold,
        })
        if train and derived.world_size == 1:
            # One rank: DeepSpeed's default reduce-scatter path flattens each bucket of gradients (torch.cat) and
            # splits it again after a reduction over that one rank, at every micro-batch (0.8 s of cat in a 30M
            # GRPO step on CPU); its all-reduce path reduces the contiguous bucket in place, the same numbers.
            # With more ranks reduce-scatter moves half the bytes and stays.
            zero["reduce_scatter"] = False
        if ds.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if train and ds.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    out = {
        "train_micro_batch_size_per_gpu": cfg.actor.micro_batch_size,
        "gradient_accumulation_steps": derived.grad_accum if train else 1,
        "train_batch_size": cfg.actor.micro_batch_size * (derived.grad_accum if train else 1) * derived.world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        "gradient_clipping": float(grad_clip) if train else 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if train and (ds.offload_optimizer or ds.offload_param) and stage > 0 and not (gpu and ds.offload_optimizer):
        # DeepSpeed insists on its own (JIT-compiled) CPU Adam with offload unless told otherwise; a CPU run
        # keeps torch AdamW (no compiled op), a GPU run with the optimizer offloaded gets the CPU Adam
        out["zero_force_ds_cpu_optimizer"] = False
    if ds.config_file:
        out = merge_user_ds_config(out, ds.config_file)
    return out


_DERIVED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def merge_user_ds_config(generated: dict, path: str, user: Optional[dict] = None) -> dict:
    """Overlay a user DeepSpeed JSON onto the generated one; batch-size keys stay derived from the job config."""
    if user is None:
        with open(path, encoding="utf-8") as fh:
            user = json.load(fh)
    if not isinstance(user, dict):
        raise ValueError(f"deepspeed.config_file {path!r}: expected a JSON object, got {type(user).__name__}")
    for key in _DERIVED_KEYS:
        if key in user and user[key] != "auto" and user[key] != generated[key]:
            raise ValueError(f"deepspeed.config_file {path!r}: {key}={user[key]} conflicts with the value derived from the job "
                             f"config ({generated[key]}); remove it or set it to \"auto\" and size batches with rollout/actor keys")
    if "optimizer" in user:
        raise ValueError(f"deepspeed.config_file {path!r}: drop the 'optimizer' section; verl_ds passes a torch AdamW "
                         "(lr from actor.lr / critic.lr) so no fused optimizer is JIT-compiled")
    _check_user_entries(user, generated, path)
    merged = dict(generated)
    for key, value in user.items():
        if key in _DERIVED_KEYS:
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
