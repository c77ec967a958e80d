"""The DeepSpeed JSON, generated from the job config by one pure function (unit-tested on CPU)."""
from __future__ import annotations

from typing import Optional

from verl_ds.config import Config, Derived
from verl_ds.config.deepspeed import derived_entries, merge_user_ds_config  # noqa: F401 (part of this module's API)
from verl_ds.engines.cpu_speed import zero3_overrides


def uses_gpu(cfg: Config) -> bool:
    """Whether the engines run on CUDA (``trainer.device``; ``auto``: when a GPU is visible)."""
    if cfg.trainer.device == "auto":
        import torch

        return torch.cuda.is_available()
    return cfg.trainer.device == "cuda"


def make_ds_config(cfg: Config, derived: Derived, role: str, grad_clip: float = 0.0,
                   gpu: Optional[bool] = None) -> dict:
    """DeepSpeed config for ``role`` in {"actor", "critic", "ref"}, batch sizes derived. The reference is an inference
    engine: ZeRO-3 when the actor is, else stage 0, as DeepSpeed-Chat's ``_init_ref`` (microsoft/DeepSpeedExamples,
    ``dschat/rlhf/rlhf_engine.py``). The optimizer goes to ``deepspeed.initialize``: DeepSpeed's "AdamW" type would
    be a JIT-compiled FusedAdam on CPU."""
    ds = cfg.deepspeed
    gpu = uses_gpu(cfg) if gpu is None else gpu
    pin = bool(gpu)  # pinned host buffers speed up GPU<->CPU copies; on a CPU-only run they only cost
    train = role in ("actor", "critic")
    stage = ds.zero_stage if train else (3 if ds.zero_stage == 3 else 0)  # the reference: see above
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update({
            **zero3_overrides(gpu),  # CPU runs: torch's own linear (verl_ds.engines.cpu_speed)
        })
        if train and derived.world_size == 1:
            # One rank: the default reduce-scatter path flattens and splits each gradient bucket at every micro-batch
            # for a reduction over that one rank; the all-reduce path reduces the bucket in place, the same numbers.
            # With more ranks reduce-scatter moves half the bytes and stays.
            zero["reduce_scatter"] = False
        if ds.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if train and ds.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    out = {
        **derived_entries(cfg, derived, train),
        "zero_optimization": zero,
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
