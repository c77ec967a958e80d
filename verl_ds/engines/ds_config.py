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
