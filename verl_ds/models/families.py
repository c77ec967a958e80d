"""Which model families packed rows and shared prompts are exact for, decided at start-up by one tiny probe forward of
the model itself (a collective under ZeRO-3), so that a family they would get wrong falls back with one log line
instead of training on wrong numbers. docs/models.md has the rules and what each family gets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_ds.attention_layout import packed_attention
from verl_ds.hf_module import (IGNORES_POSITIONS, device_of, family_name, probe_batch, probing, reads_positions,
                               sequence_convolutions, text_config, unwrap_module, vocab_size)
from verl_ds.models.varlen_attention import use_attention

__all__ = ["PackingSupport", "packing_support"]


@dataclass(frozen=True)
class PackingSupport:
    """The start-up decision for one model: ``packing`` / ``sharing``: None when exact for it, else why not;
    ``note``: why the packed rows do not run on the implementation asked for, or None."""

    family: str
    packing: Optional[str] = None
    sharing: Optional[str] = None
    note: Optional[str] = None


def _attention_chunk(model: Any) -> Optional[int]:
    """The attention chunk some layer of ``model`` uses (Llama 4's chunked attention), None when no layer does."""
    cfg = text_config(model)
    size = getattr(cfg, "attention_chunk_size", None)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return None
    types = getattr(cfg, "layer_types", None)
    return size if isinstance(types, (list, tuple)) and any("chunked" in str(t) for t in types) else None


def _forward(model: Any, packed, R: int) -> None:
    from verl_ds.models.packed_forward import packed_logprobs, packed_values
    from verl_ds.models.value import CriticLM

    if isinstance(unwrap_module(model), CriticLM):
        packed_values(model, packed, R)
    else:
        packed_logprobs(model, packed, R)


def packing_support(model: Any, max_length: Optional[int] = None, share: bool = True,
                    implementation: str = "sdpa") -> PackingSupport:
    """Whether packed rows (and, with ``share``, shared prompts) are exact for ``model``, switching it to the attention
    that serves them; ``max_length``: the longest sequence the run scores (for attention chunks)."""
    from verl_ds.packing import pack
    from verl_ds.prompt_sharing import pack_shared_prompts

    family = family_name(model)
    refuse = lambda why: PackingSupport(family, why, why)  # noqa: E731
    device_type = torch.device(device_of(model)).type
    plain = packed_attention(implementation, False, device_type)
    name, note = packed_attention(implementation, share, device_type)
    try:
        use_attention(model, name)
    except (TypeError, ValueError) as exc:
        return refuse(f"{family}: {exc}")
    convs = sequence_convolutions(model)
    if convs:
        return refuse(f"{family}: {convs[0]} convolves over the sequence (a state-space or short-convolution layer): "
                      f"it would run across the packed sequences")
    chunk = _attention_chunk(model)
    if chunk is not None and (max_length is None or chunk < max_length):
        return refuse(f"{family}: chunked attention ({chunk}-token chunks) is not kept per packed sequence; the "
                      f"sequences may be {max_length or 'longer'} tokens")
    with probing(model):
        obs, mask, R = probe_batch(vocab_size(model), device_of(model))
        try:
            if not reads_positions(model, obs[:1, :3]):
                return refuse(f"{family}: {IGNORES_POSITIONS}, so packed sequences after the first would get wrong "
                              f"positions")
            _forward(model, pack(obs, mask, R), R)
        except Exception as exc:  # noqa: BLE001 - any failure of the probe refuses packing, with its message
            return refuse(f"{family}: a packed probe forward failed ({type(exc).__name__}: {exc})")
        if not share:
            return PackingSupport(family, note=note)
        try:
            _forward(model, pack_shared_prompts(obs, mask, R, share_prefixes=True), R)
        except Exception as exc:  # noqa: BLE001
            use_attention(model, plain[0])
            return PackingSupport(family, None, f"{family}: a shared-prompt probe forward failed "
                                                f"({type(exc).__name__}: {exc})", plain[1])
    return PackingSupport(family, note=note)
