"""Which model families packed rows, shared prompts and shared generation are exact for: decided at start-up from the
model itself (``packing_support``, ``shared_generation_refusal``), so that a family they would get wrong falls back to
padded batches, plain packing or plain ``generate`` with one log line instead of training on wrong numbers.

Packed rows (``model.remove_padding``) need: attention through transformers' AttentionInterface (flash-attention's
varlen path, or ours given the row's layout), causal attention, no layer mixing tokens outside attention
(state-space, short-convolution or linear-attention layers carry state from one packed sequence into the next),
position ids that the model reads (encoder-decoder decoders such as BART's count positions from 0 over the whole
row), and a chunked-attention chunk no shorter than the longest sequence. Shared prompts (``model.share_prompts``)
need the layout to reach every attention call (StableLM's and Nemotron's decoder layers do not pass keyword arguments
on to their attention); sliding windows are part of the layout (``verl_ds.attention_layout``, which also picks the
kernel). Both are checked by one tiny forward of the model itself (a few tokens, under ``packed_row_witness``; a
collective under ZeRO-3, run alike on every rank). docs/models.md lists the families
the installed transformers ships and what each gets (tests/models/test_families.py).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_ds.models.base import unwrap_module
from verl_ds.attention_layout import packed_attention
from verl_ds.models.varlen_attention import family_name, text_config, use_attention

__all__ = ["PackingSupport", "packing_support", "shared_generation_refusal"]


@dataclass(frozen=True)
class PackingSupport:
    """The start-up decision for one model: ``packing`` / ``sharing``: None when packed rows / shared prompts are
    exact for it, else why not (naming the family); sharing is refused whenever packing is. ``note``: why the packed
    rows do not run on the implementation asked for (a start-up log line), or None."""

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


def _sequence_convolutions(model: Any) -> list[str]:
    """Modules convolving over the sequence (Mamba's, LFM2's short convolution, gated delta nets'): nn.Conv1d."""
    return [name for name, m in unwrap_module(model).named_modules() if isinstance(m, torch.nn.Conv1d)]


_GENERATION_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF module -> refusal or None


def shared_generation_refusal(model: Any) -> Optional[str]:
    """``_shared_generation_refusal`` once per model (every engine built on it after the first reuses the decision)."""
    inner = unwrap_module(model)
    if inner not in _GENERATION_DECISIONS:
        _GENERATION_DECISIONS[inner] = _shared_generation_refusal(model)
    return _GENERATION_DECISIONS[inner]


def _shared_generation_refusal(model: Any) -> Optional[str]:
    """Why shared prefill / shared decoding (``verl_ds.generation``) cannot run on ``model``, None when they can: they
    copy and re-index a key/value cache row by row, which a hybrid model's state-space, convolution or linear-attention
    state does not follow (LFM2, Falcon-H1, Qwen3-Next, ...), and give each row its own positions, which a model
    counting positions itself (BART's decoder) does not read. Runs a tiny no-grad forward (on every rank under
    ZeRO-3)."""
    family = family_name(model)
    convs = _sequence_convolutions(model)
    if convs:
        return f"{family} has layers that carry a state along the sequence ({convs[0]}), not only a key/value cache"
    try:
        with _probing(model):
            reads = _reads_positions(model, _probe_batch(_vocab(model), _device(model))[0][:1, :3])
    except Exception as exc:  # noqa: BLE001
        return f"{family}: a probe forward failed ({type(exc).__name__}: {exc})"
    finally:
        if callable(getattr(model, "empty_partition_cache", None)):
            model.empty_partition_cache()  # ZeRO-3 keeps the layers gathered after a direct module call
    if not reads:  # shared decoding gives each row the positions of its own prompt + response
        return f"{family}: {_IGNORES_POSITIONS}"
    try:
        with _probing(model):
            _shared_generation_runs(model)
    except Exception as exc:  # noqa: BLE001
        return f"{family}: a shared-generation probe failed ({type(exc).__name__}: {exc})"
    finally:
        if callable(getattr(model, "empty_partition_cache", None)):
            model.empty_partition_cache()
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

        layers = DynamicCache(config=unwrap_module(model).config).layers
    except Exception as exc:  # a config transformers cannot build a cache for: no rows to share
        return f"{family}: no key/value cache can be built from its config ({type(exc).__name__}: {exc})"
    for layer in layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            return f"{family} has linear-attention or state-space layers ({type(layer).__name__} in its cache)"
        if not isinstance(layer, DynamicLayer) and not callable(getattr(layer, "batch_select_indices", None)):
            return f"{family}: its cache layer {type(layer).__name__} cannot select rows"
    return None


def _shared_generation_runs(model: Any) -> None:
    """Run the shared prefill on three rows (two the same prompt, one left-padded), then ``generate`` from it and
    ``decode_distinct`` from it, two tokens each: raises where a family's cache cannot be shared (DeepSeek-V4's).
    Only that it runs: the structural checks and tests/models/test_families.py say whether it draws what generate
    draws (a token comparison here would flip on near ties in bf16)."""
    from transformers import GenerationConfig

    from verl_ds.generation import SampledTokenStats, decode_distinct, shared_prefill

    inner = unwrap_module(model)
    obs, mask, _ = _probe_batch(_vocab(model), _device(model))
    ids, mask = obs[1:, :3], mask[1:, :3].long()  # prompt a twice (no pad), prompt b (one pad)
    ids, mask = torch.cat([ids[:1], ids], 0), torch.cat([mask[:1], mask], 0)
    # an end id outside the vocabulary: no row ends
    config = GenerationConfig(do_sample=False, max_new_tokens=1, num_beams=1, pad_token_id=0,
                              eos_token_id=_vocab(model), use_cache=True)
    for expand in (True, False):
        pre = shared_prefill(inner, ids, mask, expand=expand)
        if pre is None:  # no cache to share: the engine runs plain generate for it anyway
            continue
        first = pre.logits.argmax(-1)
        ids1, mask1 = torch.cat([ids, first[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if expand:
            inner.generate(input_ids=ids1, attention_mask=mask1, generation_config=config, **pre.cache)
        else:
            decode_distinct(inner, pre, ids1, mask1, SampledTokenStats(1.0), config)


def _probe_batch(vocab: int, device) -> tuple:
    """(observation, mask, R): two prompts of 3 and 2 tokens, two samples each, the responses of the first sharing
    their first token (so the probe covers shared prompts and shared response prefixes)."""
    ids = [3 + (7 * i) % max(1, vocab - 3) for i in range(1, 12)]
    pa, pb = ids[:3], ids[3:5]
    rows = [(pa, ids[5:8]), (pa, [ids[5], ids[8], ids[9]]), (pb, ids[9:11]), (pb, [ids[10], ids[6]])]
    P, R = 3, 3
    obs = torch.zeros(4, P + R, dtype=torch.long)
    mask = torch.zeros(4, P + R, dtype=torch.bool)
    for b, (p, r) in enumerate(rows):
        obs[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), True
        obs[b, P:P + len(r)], mask[b, P:P + len(r)] = torch.tensor(r), True
    return obs.to(device), mask.to(device), R


def _vocab(model: Any) -> int:
    return int(getattr(text_config(model), "vocab_size", 0) or 32)


def _device(model: Any):
    dev = getattr(model, "device", None)
    if isinstance(dev, (torch.device, str)):
        return dev
    return next(unwrap_module(model).parameters()).device


def _forward(model: Any, packed, R: int) -> None:
    from verl_ds.models.packed_forward import packed_logprobs, packed_values
    from verl_ds.models.value import CriticLM

    if isinstance(unwrap_module(model), CriticLM):
        packed_values(model, packed, R)
    else:
        packed_logprobs(model, packed, R)


def _output(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])


def _reads_positions(model: Any, ids: torch.Tensor) -> bool:
    """Whether the model's output depends on the position ids it is given (one sequence of ``ids`` (1, 3), at positions
    0, 1, 2 and at 0, 2, 4: other distances, which rotary embeddings see too, where a mere shift is invisible to them;
    an attention mask and the sequence's bounds, so that no attention splits it at the jump): bit-equal outputs mean it
    counts positions itself (from the row's start or its cache's length), not from the ids packing or shared decoding
    give."""
    n = ids.shape[1]
    pos = torch.arange(n, device=ids.device)[None]
    bounds = torch.tensor([0, n], dtype=torch.int32, device=ids.device)  # verl_ds_varlen_sdpa: one sequence
    kw = {"use_cache": False, "attention_mask": torch.ones_like(ids), "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
          "max_length_q": n, "max_length_k": n}
    first = _output(model(input_ids=ids, position_ids=pos, **kw))
    return not torch.equal(first, _output(model(input_ids=ids, position_ids=pos * 2, **kw)))


@contextlib.contextmanager
def _probing(model: Any):
    """No grad, eval mode (no dropout: the position probe compares outputs bit for bit), the training flag restored."""
    inner = unwrap_module(model)
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        inner.train(was_training)


_IGNORES_POSITIONS = ("its output does not depend on the position ids it is given (it counts positions itself, e.g. "
                      "an encoder-decoder's decoder from the row's start)")


def packing_support(model: Any, max_length: Optional[int] = None, share: bool = True,
                    implementation: str = "sdpa") -> PackingSupport:
    """Whether packed rows (and, with ``share``, shared prompts and response prefixes) are exact for ``model`` (a HF
    causal LM, a CriticLM, or a DeepSpeed engine around one), switched to the attention that serves them with the
    resolved ``implementation`` (``attention_layout.packed_attention``); ``max_length``: the longest prompt +
    response the run will score (for attention chunks; None: refused where the model has chunks). Runs a tiny
    no-grad forward of the model (on every rank under ZeRO-3); see the module docstring for what is checked. Where
    sharing is refused, the model is switched back to the plain-packing attention."""
    from verl_ds.packing import pack
    from verl_ds.prompt_sharing import pack_shared_prompts

    family = family_name(model)
    refuse = lambda why: PackingSupport(family, why, why)  # noqa: E731
    device_type = torch.device(_device(model)).type
    plain = packed_attention(implementation, False, device_type)
    name, note = packed_attention(implementation, share, device_type)
    try:
        use_attention(model, name)
    except (TypeError, ValueError) as exc:
        return refuse(f"{family}: {exc}")
    convs = _sequence_convolutions(model)
    if convs:
        return refuse(f"{family}: {convs[0]} convolves over the sequence (a state-space or short-convolution layer): "
                      f"it would run across the packed sequences")
    chunk = _attention_chunk(model)
    if chunk is not None and (max_length is None or chunk < max_length):
        return refuse(f"{family}: chunked attention ({chunk}-token chunks) is not kept per packed sequence; the "
                      f"sequences may be {max_length or 'longer'} tokens")
    with _probing(model):
        obs, mask, R = _probe_batch(_vocab(model), _device(model))
        try:
            if not _reads_positions(model, obs[:1, :3]):
                return refuse(f"{family}: {_IGNORES_POSITIONS}, so packed sequences after the first would get wrong "
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
