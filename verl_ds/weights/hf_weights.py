"""A model's weights as a plain HF model names them, one module at a time: the one source of the generation
replica (``weights.replica``) and the HF export (``verl_ds.export``). A LoRA model comes out as its base with each
adapted weight merged (W + B A * alpha / r) while its layer is gathered, never in place; a tied parameter comes once.
"""
from __future__ import annotations

from typing import Callable

import torch

from verl_ds.weights.zero3 import full_shape, persistent_buffers


def _is_peft(module) -> bool:
    from verl_ds.weights.lora import is_peft_model

    return is_peft_model(module)


def hf_model(module) -> torch.nn.Module:
    """The plain HF model whose class, config and names the weights have (a peft model's base model)."""
    module = getattr(module, "module", module)
    return module.get_base_model() if _is_peft(module) else module


def weight_groups(module) -> list:
    """[(params to gather, [(plain HF name, full shape, dtype, produce())])] in module order; ``produce()`` is
    called while the group's parameters are gathered; each parameter appears once."""
    module = getattr(module, "module", module)
    lora_layer = saved = None
    if _is_peft(module):
        from peft.tuners.lora import LoraLayer as lora_layer
        from peft.utils import ModulesToSaveWrapper as saved
    groups, seen, inside = [], set(), None
    for name, sub in hf_model(module).named_modules():
        if inside is not None and name.startswith(inside):
            continue  # a LoRA layer's own submodules (base_layer, lora_A, lora_B, dropout)
        inside = None
        if lora_layer is not None and isinstance(sub, lora_layer):
            inside = f"{name}."
            params = [p for p in sub.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            outs = [(f"{name}.{pname}", tuple(full_shape(p)), p.dtype,
                     _merged_weight(sub, p) if pname == "weight" else p.detach)
                    for pname, p in sub.get_base_layer().named_parameters(recurse=False)]
            groups.append((params, outs))
            continue
        if saved is not None and isinstance(sub, saved):
            # a module peft trains whole (modules_to_save: a classifier's score head): the copy its forward uses,
            # under the wrapped module's name, as peft's merge_and_unload leaves it
            inside = f"{name}."
            active = [a for a in sub.active_adapters if a in sub.modules_to_save]
            use = sub.modules_to_save[active[0]] if active and not sub.disable_adapters else sub.original_module
            named = [(pname, p) for pname, p in use.named_parameters() if id(p) not in seen]
            seen.update(id(p) for p in sub.parameters())
            if named:
                groups.append(([p for _, p in named], [(f"{name}.{pname}", tuple(full_shape(p)), p.dtype, p.detach)
                                                       for pname, p in named]))
            continue
        named = [(pname, p) for pname, p in sub.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in named)
        if named:
            groups.append(([p for _, p in named], [(f"{name}.{pname}" if name else pname, tuple(full_shape(p)),
                                                    p.dtype, p.detach) for pname, p in named]))
    return groups


def _merged_weight(layer, weight) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        if getattr(layer, "merged", False):
            raise RuntimeError("weight_groups: a LoRA layer is merged in place; unmerge it first")
        merged = weight.detach().clone()
        if not getattr(layer, "disable_adapters", False):
            for adapter in layer.active_adapters:
                if adapter in layer.scaling:
                    merged += layer.get_delta_weight(adapter).to(merged.dtype)
        return merged
    return produce


def weight_buffers(module) -> list:
    """[(plain HF name, buffer)] of the model's persistent buffers."""
    module = getattr(module, "module", module)
    if not _is_peft(module):
        return persistent_buffers(module)
    return [(name.replace(".base_layer.", "."), buf) for name, buf in persistent_buffers(hf_model(module))]
