"""Export a (ZeRO-3) model in HF format, streamed: one module gathered at a time, only rank 0 writes.

The output is what ``save_pretrained(safe_serialization=True)`` writes and
``AutoModelForCausalLM.from_pretrained`` reads (https://huggingface.co/docs/safetensors and the
sharded-checkpoint format of transformers' ``save_pretrained``): ``config.json``,
``generation_config.json`` when the model has one, the tokenizer files, and the weights in
safetensors files of at most ``max_shard_size`` bytes each, with ``model.safetensors.index.json``
mapping every tensor to its file when there is more than one.

Memory: every rank holds one module's gathered parameters at a time (DeepSpeed gathers on all ranks);
rank 0 also holds the shard being filled (at most ``max_shard_size``) as CPU tensors. Nobody builds
a whole state dict. A tied LM head is written once, under the embedding's name, as HF does.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from typing import Optional, Union

import torch

from verl_ds import dist as vdist
from verl_ds.engines.zero3 import is_partitioned, persistent_buffers

INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10^9, as HF) or ``"512MiB"`` (2^20)."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size: expected an int or a size such as '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m:
            raise ValueError(f"max_shard_size: expected an int or a size such as '5GB' or '512MiB', got {size!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value < 1:
        raise ValueError(f"max_shard_size: must be at least 1 byte, got {size!r}")
    return value


def _export_order(module: torch.nn.Module) -> list:
    """[(module, [(name, param)])] in module order, each parameter once under the first name it has
    (a tied LM head is the embedding's parameter, already listed)."""
    seen: set = set()
    order = []
    for module_name, sub in module.named_modules():
        params = []
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            params.append((f"{module_name}.{name}" if module_name else name, param))
        if params:
            order.append((sub, params))
    return order


class _ShardWriter:
    """Rank 0's shard buffer: CPU tensors up to ``limit`` bytes, flushed to numbered temporary files."""

    def __init__(self, directory: str, limit: int):
        self.directory, self.limit = directory, limit
        self.tensors: dict = {}
        self.nbytes = 0
        self.files: list = []  # [(temp path, [names])]
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.tensors and self.nbytes + size > self.limit:
            self.flush()
        self.tensors[name] = tensor
        self.nbytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.tensors:
            return
        path = os.path.join(self.directory, f".shard-{len(self.files) + 1:05d}.tmp")
        save_file(self.tensors, path, metadata={"format": "pt"})
        self.files.append((path, list(self.tensors)))
        self.tensors, self.nbytes = {}, 0

    def finish(self) -> list:
        """Rename the shards to HF's names, write the index when there are several; returns the file names."""
        self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for (tmp, keys), final in zip(self.files, names):
            os.replace(tmp, os.path.join(self.directory, final))
            weight_map.update({k: final for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(self.directory, INDEX_FILE), "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2)
        return names


def _clear_old_weights(directory: str) -> None:
    for name in os.listdir(directory):
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|\.shard-\d+\.tmp|"
                        r"pytorch_model.*\.bin(\.index\.json)?", name):
            os.remove(os.path.join(directory, name))


@torch.no_grad()
def export_hf(engine_module, tokenizer, directory: str, max_shard_size: Union[int, str] = "5GB",
              dtype: Optional[torch.dtype] = None) -> str:
    """Write ``engine_module`` (a HF model, possibly ZeRO-3 partitioned, or a DeepSpeed engine around one) and
    ``tokenizer`` (or None) to ``directory`` in HF format; every rank must call it. Returns ``directory``.

    ``dtype``: the saved dtype (default: the parameters' own). Only rank 0 touches the file system.
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    module = getattr(engine_module, "module", engine_module)
    limit = parse_size(max_shard_size)
    main = vdist.rank() == 0
    if main:
        os.makedirs(directory, exist_ok=True)
        _clear_old_weights(directory)
    writer = _ShardWriter(directory, limit) if main else None
    saved_dtype = None
    for _, params in _export_order(module):
        tensors = [p for _, p in params]
        gather = GatheredParameters(tensors, modifier_rank=None) if any(map(is_partitioned, tensors)) \
            else contextlib.nullcontext()
        with gather:
            if main:
                for name, param in params:
                    out = param.detach().to("cpu", dtype=dtype or param.dtype, copy=True).contiguous()
                    saved_dtype = saved_dtype or out.dtype
                    writer.add(name, out)
    if main:
        for name, buf in persistent_buffers(module):
            writer.add(name, buf.detach().to("cpu", copy=True).contiguous())
        writer.finish()
        config = copy.deepcopy(module.config)
        if saved_dtype is not None:
            config.dtype = saved_dtype
        config.save_pretrained(directory)
        generation_config = getattr(module, "generation_config", None)
        if generation_config is not None and getattr(module, "can_generate", lambda: False)():
            generation_config.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    vdist.barrier()
    return directory
