"""A lean generation replica of a (ZeRO-3) actor: built once, refreshed in place, one module at a time.

``generate`` on a ZeRO-3 module gathers every layer's parameters at every token; a resident whole
copy runs with no collectives per token (peers report ~10x faster rollouts, e.g. OpenRLHF's and
verl's weight sync into a separate inference engine). This replica costs one copy of the actor in
the training dtype on the engines' device, and nothing more:

- built once from the module's config, with HF's ``no_init_weights`` (no random init, the RNG is
  never drawn: resume stays bitwise exact) and with no ZeRO-3 construction context active;
- ``refresh()`` walks the source's modules; each module's own parameters are gathered
  (``GatheredParameters``, a collective every rank joins), copied into the replica's parameters
  on the same device, and released before the next module: the extra memory is one module's
  parameters, with no fp32 state dict and no CPU round trip;
- tied parameters (an LM head tied to the embedding) are copied once, and a replica whose tying
  differs from the source's is refused rather than silently left half-stale.

When the replica would not fit (``verl-ds plan`` says so), generate from the engine's module with
``rollout.gather_params=false`` instead.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch

from verl_ds.engines.zero3 import is_partitioned, persistent_buffers


def _source_module(module_or_engine) -> torch.nn.Module:
    return getattr(module_or_engine, "module", module_or_engine)


def _source_dtype(module: torch.nn.Module) -> torch.dtype:
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.float32


def build_empty_replica(module: torch.nn.Module, device=None, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """An un-partitioned model of ``module``'s class and config, uninitialised, on ``device`` in ``dtype``
    (default: the source's parameter dtype). No RNG is drawn and no collective is entered."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a live HfDeepSpeedConfig would turn this into a (rank-local, hanging) zero.Init
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    config = copy.deepcopy(module.config)
    dtype = dtype or _source_dtype(module)
    device = torch.device(device) if device is not None else torch.device("cpu")
    devices = [device.index or 0] if device.type == "cuda" else []
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=devices), no_init_weights(), device:
        torch.set_default_dtype(dtype)  # parameters are created in the training dtype, no fp32 detour
        try:
            replica = type(module)(config)
        finally:
            torch.set_default_dtype(previous)
    if hasattr(replica, "tie_weights"):
        replica.tie_weights()  # no_init_weights also skips the tying that init_weights would do
    replica.to(device=device, dtype=dtype)
    replica.eval()
    replica.requires_grad_(False)
    return replica


class GenerationReplica:
    """A whole, un-partitioned copy of ``source`` (a HF model, possibly ZeRO-3 partitioned, or an engine)
    for ``generate``; ``refresh()`` (collective under ZeRO-3) copies the current weights into it in place."""

    def __init__(self, source, device=None, dtype: Optional[torch.dtype] = None):
        self.source = _source_module(source)
        self.model = build_empty_replica(self.source, device=device, dtype=dtype)
        self._plan = self._copy_plan()
        replica_buffers = dict(self.model.named_buffers())
        self._buffers = [(buf, replica_buffers[name]) for name, buf in persistent_buffers(self.source)
                         if name in replica_buffers]
        self.refreshes = 0

    def _copy_plan(self) -> list:
        """[(source module, [(source param, [replica params])])] in module order, each source param once."""
        dst_params = dict(self.model.named_parameters(remove_duplicate=False))
        src_named = list(self.source.named_parameters(remove_duplicate=False))
        missing = [name for name, _ in src_named if name not in dst_params]
        if missing:
            raise ValueError(f"GenerationReplica: the replica built from the config lacks parameters {missing[:5]} "
                             f"of the source {type(self.source).__name__}")
        names_of: dict = {}
        for name, param in src_named:
            names_of.setdefault(id(param), []).append(name)
        filled_by: dict = {}
        seen: set = set()
        plan = []
        for module_name, module in self.source.named_modules():
            pairs = []
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                targets = {id(dst_params[n]): dst_params[n] for n in names_of[id(param)]}
                for key in targets:
                    if filled_by.setdefault(key, id(param)) != id(param):
                        raise ValueError(f"GenerationReplica: replica parameter {names_of[id(param)]} is tied to "
                                         "another one that the source keeps separate; the tying of the replica's "
                                         "config differs from the source's")
                pairs.append((param, list(targets.values())))
            if pairs:
                plan.append((module, pairs))
        return plan

    @torch.no_grad()
    def refresh(self) -> torch.nn.Module:
        """Copy the source's current weights (and persistent buffers) into the replica; returns the replica.

        Under ZeRO-3 every rank must call it (each module's gather is a collective).
        """
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        for module, pairs in self._plan:
            params = [p for p, _ in pairs]
            gather = GatheredParameters(params, modifier_rank=None) if any(map(is_partitioned, params)) \
                else contextlib.nullcontext()
            with gather:
                for src, targets in pairs:
                    for dst in targets:
                        dst.copy_(src.data)
        for src, dst in self._buffers:  # ZeRO-3 keeps buffers whole on every rank
            dst.copy_(src)
        self.refreshes += 1
        return self.model
