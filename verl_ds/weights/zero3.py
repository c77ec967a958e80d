"""ZeRO-3 plumbing shared by construction, the generation replica and the export: build HF models already
partitioned (``partitioned_construction``), copy weights between plain and partitioned modules without a whole
model on any rank (``copy_params``), and gather parameters only when they are partitioned (``gathered``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist


def zero3_config(ds_config: Optional[dict]) -> bool:
    return bool(ds_config) and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


@contextlib.contextmanager
def partitioned_construction(ds_config: Optional[dict]) -> Iterator[None]:
    """HF models built in this block are created ZeRO-3 partitioned (transformers' ``HfDeepSpeedConfig``,
    https://huggingface.co/docs/transformers/main/en/deepspeed#non-trainer-deepspeed-integration; every rank enters;
    a no-op below stage 3). Unset on exit: HF code later run on one rank would hang in a collective."""
    if not zero3_config(ds_config):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # transformers keeps only a weak reference: this local keeps the config alive for the block
    hf_config = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (it carries a ``ds_id`` and its shard in ``ds_tensor``)."""
    return hasattr(param, "ds_id")


def has_partitioned_params(module: torch.nn.Module) -> bool:
    return any(is_partitioned(p) for p in module.parameters())


def full_shape(param: torch.Tensor) -> torch.Size:
    """The un-partitioned shape (a partitioned parameter's ``.shape`` is (0,))."""
    return param.ds_shape if is_partitioned(param) else param.shape


def full_numel(param: torch.Tensor) -> int:
    return param.ds_numel if is_partitioned(param) else param.numel()


def gathered(params):
    """``GatheredParameters`` over ``params`` when any is ZeRO-3 partitioned (a collective), else a no-op."""
    if any(map(is_partitioned, params)):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        return GatheredParameters(list(params), modifier_rank=None)
    return contextlib.nullcontext()


def _partition_rank(param) -> int:
    group = getattr(param, "ds_process_group", None)
    return dist.get_rank(group=group) if dist.is_initialized() else 0


def _shard_bounds(param) -> tuple[int, int]:
    """(start, count) of this rank's real elements in the flattened full tensor (the shard's tail may be padding)."""
    size = param.ds_tensor.ds_numel
    start = _partition_rank(param) * size
    return start, max(0, min(size, param.ds_numel - start))


@torch.no_grad()
def copy_param(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src (same full shape); either side plain or ZeRO-3 partitioned (dst must not be gathered now)."""
    if tuple(full_shape(src)) != tuple(full_shape(dst)):
        raise ValueError(f"copy_param: shapes differ: source {tuple(full_shape(src))}, "
                         f"destination {tuple(full_shape(dst))}")
    if is_partitioned(dst):
        start, count = _shard_bounds(dst)
        shard = dst.ds_tensor.data
        if is_partitioned(src) and src.ds_tensor.ds_numel == dst.ds_tensor.ds_numel:
            shard.copy_(src.ds_tensor.data.to(shard.device))  # same layout: this rank's shard, no communication
        elif is_partitioned(src):  # another partitioning (not built by us): gather just this parameter
            with gathered([src]):
                shard[:count].copy_(src.data.reshape(-1)[start:start + count])
        else:
            shard[:count].copy_(src.data.reshape(-1)[start:start + count].to(shard.device))
        return
    with gathered([src]):
        dst.data.copy_(src.data.to(dst.device))


def copy_params(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy every parameter and persistent buffer of ``dst`` from ``src`` (the same names); returns the count.
    A collective when a partitioned source meets a plain destination."""
    src_params = dict(src.named_parameters())
    copied = 0
    for name, param in dst.named_parameters():
        if name not in src_params:
            raise KeyError(f"copy_params: the source has no parameter {name!r} (for destination {name!r}); "
                           f"it has e.g. {sorted(src_params)[:5]}")
        copy_param(src_params[name], param)
        copied += 1
    src_buffers = dict(src.named_buffers())
    with torch.no_grad():
        for name, buf in persistent_buffers(dst):
            if name in src_buffers:
                buf.copy_(src_buffers[name].to(buf.device))
    return copied

def persistent_buffers(module: torch.nn.Module) -> list:
    """[(name, buffer)] of the buffers a state dict holds (rotary caches etc. are non-persistent), without
    calling ``state_dict()`` (which would touch every partitioned parameter)."""
    out = []
    for module_name, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def release_free_memory() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``; a no-op elsewhere): glibc keeps the holes
    of the whole-parameter buffers that building partitioned models frees resident, under the next stage's peak."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        pass
