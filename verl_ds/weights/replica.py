"""A resident whole copy of a (ZeRO-3) actor for ``generate``, built once and refreshed in place: no collective per
token, for one copy of the actor in the training dtype (too big: ``rollout.gather_params=false``, ``verl-ds plan``).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from verl_ds.weights.hf_weights import hf_model, weight_buffers, weight_groups
from verl_ds.weights.zero3 import gathered


def _source_dtype(module: torch.nn.Module) -> torch.dtype:
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.float32


def build_empty_replica(module: torch.nn.Module, device=None, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """An un-partitioned, uninitialised model of ``module``'s class and config on ``device`` in ``dtype`` (default:
    the source's); no RNG is drawn (resume stays bitwise exact) and no collective is entered."""
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
    """A whole copy of ``source`` (a HF model, possibly ZeRO-3 partitioned or a peft model whose adapters it merges,
    or an engine around one) for ``generate``; a tying that differs from the source's is refused."""

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
        """Copy the source's current weights and buffers in, one module's gather at a time (a collective under ZeRO-3;
        the extra memory is one module's parameters); returns the replica."""
        for params, outs in self._groups:
            with gathered(params):
                for name, _, _, produce in outs:
                    self._targets[name].copy_(produce())
        for src, dst in self._buffers:  # ZeRO-3 keeps buffers whole on every rank
            dst.copy_(src)
        self.refreshes += 1
        return self.model
