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
  differs from the source's is refused rather than silently left half-stale;
- a LoRA actor's replica is its plain base model holding W + B A * alpha / r, recomputed at each refresh.

When the replica would not fit (``verl-ds plan`` says so), generate from the engine's module with
``rollout.gather_params=false`` instead.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from verl_ds.engines.hf_weights import hf_model, weight_buffers, weight_groups
from verl_ds.engines.zero3 import gathered


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
    """A whole, un-partitioned copy of ``source`` (a HF model, possibly ZeRO-3 partitioned, a peft model whose
    adapters it merges, or an engine around one) for ``generate``; ``refresh()`` (collective under ZeRO-3) copies
    the current weights (``engines.hf_weights``) into it in place. The source is never modified."""

    def __init__(self, source, device=None, dtype: Optional[torch.dtype] = None):
        self.source = getattr(source, "module", source)
        self.model = build_empty_replica(hf_model(self.source), device=device, dtype=dtype)
        dst = dict(self.model.named_parameters(remove_duplicate=False))
        self._groups = weight_groups(self.source)
        missing = [n for _, outs in self._groups for n, *_ in outs if n not in dst]
        if missing:
            raise ValueError(f"GenerationReplica: the replica built from the config lacks parameters {missing[:5]} "
                             f"of the source {type(self.source).__name__}")
        filled: dict = {}
        for _, outs in self._groups:
            for n, *_ in outs:
                if filled.setdefault(id(dst[n]), n) != n:
                    raise ValueError(f"GenerationReplica: replica parameter {n!r} is tied to another one that "
                                     f"the source keeps separate ({filled[id(dst[n])]!r}); the tying of the "
                                     "replica's config differs from the source's")
        unfilled = sorted({n for n, p in dst.items() if id(p) not in filled})
        if unfilled:
            raise ValueError(f"GenerationReplica: the source has nothing for replica parameters {unfilled[:5]} (the "
                             "source ties them, the replica's config does not)")
        self._targets = {n: dst[n] for _, outs in self._groups for n, *_ in outs}
        replica_buffers = dict(self.model.named_buffers())
        self._buffers = [(buf, replica_buffers[n]) for n, buf in weight_buffers(self.source) if n in replica_buffers]
        self.refreshes = 0

    @torch.no_grad()
    def refresh(self) -> torch.nn.Module:
        """Copy the source's current weights (and persistent buffers) into the replica; returns the replica.
        Under ZeRO-3 every rank must call it (each module's gather is a collective)."""
        for params, outs in self._groups:
            with gathered(params):
                for name, _, _, produce in outs:
                    self._targets[name].copy_(produce())
        for src, dst in self._buffers:  # ZeRO-3 keeps buffers whole on every rank
            dst.copy_(src)
        self.refreshes += 1
        return self.model
