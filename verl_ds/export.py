"""Export a (ZeRO-3) model in HF format, streamed: one module gathered at a time, only rank 0 writes, and no whole
state dict is built. The output is what ``save_pretrained(safe_serialization=True)`` writes (sharded safetensors,
https://huggingface.co/docs/safetensors) and ``from_pretrained`` reads; docs/stages.md, "Checkpoints and export"."""
from __future__ import annotations

import copy
import json
import os
import re
from typing import Optional, Union

import torch

from verl_ds import dist as vdist
from verl_ds.weights.hf_weights import hf_model, weight_buffers, weight_groups
from verl_ds.weights.zero3 import gathered

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


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def plan_shards(entries: list, limit: int) -> list:
    """Split [(name, shape, dtype)] in order into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for name, shape, dtype in entries:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, tuple(shape), dtype, nbytes))
        size += nbytes
    if current:
        shards.append(current)
    return shards


class _StreamingShard:
    """A safetensors file written as its tensors arrive: the header is known from the shapes alone, so it goes first
    (https://github.com/huggingface/safetensors#format) and nothing beyond the tensor being written is buffered."""

    def __init__(self, path: str, layout: list):
        self.layout, self.next, self.path = layout, 0, path
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, nbytes in layout:
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        self.fh = open(path, "wb")
        self.fh.write(len(blob).to_bytes(8, "little") + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, shape, dtype, _ = self.layout[self.next]
        if name != expected or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(f"export: expected {expected} {shape} {dtype} next, got {name} "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
        self.fh.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.next += 1
        if self.next == len(self.layout):
            self.fh.close()

    @property
    def done(self) -> bool:
        return self.next == len(self.layout)


def _clear_old_weights(directory: str) -> None:
    for name in os.listdir(directory):
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|\.shard-\d+\.tmp|"
                        r"pytorch_model.*\.bin(\.index\.json)?", name):
            os.remove(os.path.join(directory, name))


def _file_names(n: int) -> list:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


@torch.no_grad()
def export_hf(engine_module, tokenizer, directory: str, max_shard_size: Union[int, str] = "5GB",
              dtype: Optional[torch.dtype] = None) -> str:
    """Write a HF model (possibly ZeRO-3 partitioned, or in a DeepSpeed engine) and ``tokenizer`` (or None) to
    ``directory``; collective, only rank 0 writes. ``dtype``: of floating tensors (default: their own)."""
    limit = parse_size(max_shard_size)
    main = vdist.rank() == 0
    # a LoRA model: its plain HF base model, each adapted weight merged (W + B A * alpha / r)
    groups, buffers, hf_module = weight_groups(engine_module), weight_buffers(engine_module), hf_model(engine_module)

    def out_dtype(d):
        return dtype if dtype is not None and d.is_floating_point else d

    entries = [(name, shape, out_dtype(d)) for _, outs in groups for name, shape, d, _ in outs]
    entries += [(name, b.shape, b.dtype) for name, b in buffers]
    shards = plan_shards(entries, limit)
    names = _file_names(len(shards))
    writers = []
    if main:
        os.makedirs(directory, exist_ok=True)
        _clear_old_weights(directory)
        writers = [_StreamingShard(os.path.join(directory, f".shard-{i:05d}.tmp"), layout)
                   for i, layout in enumerate(shards)]
    pending = iter(writers)
    current = next(pending, None)

    def emit(name, tensor):
        nonlocal current
        current.write(name, tensor)
        if current.done:
            current = next(pending, None)

    for params, outs in groups:
        with gathered(params):
            if main:
                for name, _, d, produce in outs:
                    emit(name, produce().to("cpu", dtype=out_dtype(d)))
    if main:
        for name, buf in buffers:
            emit(name, buf.detach().to("cpu"))
        weight_map = {}
        for writer, final, layout in zip(writers, names, shards):
            os.replace(writer.path, os.path.join(directory, final))
            weight_map.update({name: final for name, *_ in layout})
        if len(names) > 1:
            total = sum(nbytes for layout in shards for *_, nbytes in layout)
            with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                          indent=2)
        config = copy.deepcopy(hf_module.config)
        floats = [d for _, _, d in entries if d.is_floating_point]
        if floats:
            config.dtype = floats[0]
        config.save_pretrained(directory)
        generation_config = getattr(hf_module, "generation_config", None)
        if generation_config is not None and getattr(hf_module, "can_generate", lambda: False)():
            generation_config.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    vdist.barrier()
    return directory


EXPORT_FORMATS = ("merged", "adapter")


def export_format(cfg) -> str:
    """The format ``trainer.export`` asks for: ``adapter``, else ``merged`` (``none`` too, for an explicit export)."""
    return "adapter" if cfg.trainer.export == "adapter" else "merged"


def export_actor(engine_module, tokenizer, directory: str, fmt: str = "merged",
                 base_model_path: Optional[str] = None) -> str:
    """The trained actor per ``trainer.export``: ``merged`` (a plain HF model, LoRA adapters folded in) or ``adapter``
    (peft's files); collective, returns ``directory``."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format: expected one of {EXPORT_FORMATS}, got {fmt!r}")
    if fmt == "adapter":
        return export_adapter(engine_module, tokenizer, directory, base_model_path=base_model_path)
    return export_hf(engine_module, tokenizer, directory)


def export_adapter(engine_module, tokenizer, directory: str, base_model_path: Optional[str] = None) -> str:
    """Write a peft model's adapters to ``directory`` (collective; rank 0 writes), ``base_model_path`` as their base;
    without one the frozen base goes to ``directory/base``, so ``PeftModel.from_pretrained(base, directory)`` works."""
    from safetensors.torch import save_file

    from verl_ds.weights.lora import ADAPTER_NAME, adapter_state_dict, adapters_off, is_peft_model

    module = getattr(engine_module, "module", engine_module)
    if not is_peft_model(module):
        raise TypeError(f"export_adapter: the model has no LoRA adapters ({type(module).__name__}); "
                        "use trainer.export=merged")
    if base_model_path is None:
        base_dir = os.path.join(directory, "base")
        with adapters_off(module):  # the merged weights of a model with its adapters off: the base's
            export_hf(module, tokenizer, base_dir)
        base_model_path = os.path.abspath(base_dir)
    sd = adapter_state_dict(module)
    if vdist.rank() == 0:
        os.makedirs(directory, exist_ok=True)
        config = copy.copy(module.peft_config[ADAPTER_NAME])
        config.base_model_name_or_path = base_model_path
        config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(directory, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    vdist.barrier()
    return directory
