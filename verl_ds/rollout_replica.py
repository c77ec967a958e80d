"""Gathering a ZeRO-3 module into a plain replica (the generation replica and the HF export use it)."""
from __future__ import annotations

import copy

import torch


def gathered_state_dict(module: torch.nn.Module) -> dict:
    """Full (un-sharded) parameters and buffers of a ZeRO-3 (or plain) module as CPU tensors, on every rank."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    out = {}
    # remove_duplicate=False: a tied LM head (Qwen2.5-0.5B, ...) is its own key in the replica's state dict
    for name, param in module.named_parameters(remove_duplicate=False):
        with GatheredParameters([param], modifier_rank=None):
            out[name] = param.detach().to("cpu", copy=True)
    persistent = set(module.state_dict().keys())  # rotary caches etc. are non-persistent: not part of a checkpoint
    for name, buf in module.named_buffers():
        if name in persistent:
            out[name] = buf.detach().to("cpu", copy=True)
    return out


def empty_like(module: torch.nn.Module, device=None) -> torch.nn.Module:
    """A plain (un-partitioned) model of the same architecture, built from its config, on ``device``."""
    config = copy.deepcopy(module.config)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # never let the replica build enter a ZeRO-3 collective
    except ImportError:
        pass
    with torch.random.fork_rng(devices=[]):  # weight init must not move the RNG: resume is exact
        replica = type(module)(config)
    dtype = next(module.parameters()).dtype
    return replica.to(dtype=dtype, device=device)
