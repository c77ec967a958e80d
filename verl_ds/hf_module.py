"""What a HF model is, read off the module or probed with a tiny no-grad forward (its wrappers, forward parameters,
family, text config, whether it reads position ids): the one place ``verl_ds.generation`` and ``verl_ds.models`` ask."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn as nn

__all__ = ["unwrap_module", "forward_params", "family_name", "text_config", "probing", "probe_batch", "vocab_size",
           "device_of", "output_of", "reads_positions", "sequence_convolutions", "IGNORES_POSITIONS"]

IGNORES_POSITIONS = ("its output does not depend on the position ids it is given (it counts positions itself, e.g. "
                     "an encoder-decoder's decoder from the row's start)")


def unwrap_module(m: Any) -> Any:
    """The innermost model under DeepSpeed/DDP wrappers (their ``.module``), else ``m``."""
    seen = 0
    while isinstance(m, nn.Module) and hasattr(m, "module") and isinstance(m.module, nn.Module) and seen < 4:
        m, seen = m.module, seen + 1
    return m


def forward_params(module: Any) -> set[str]:
    """Parameter names of a HF model's forward (a peft model's base's); empty when the signature cannot be read."""
    if callable(getattr(module, "get_base_model", None)) and hasattr(module, "peft_config"):
        module = module.get_base_model()  # a peft model passes keyword arguments on to its base model's forward
    fwd = getattr(module, "forward", module)
    try:
        return set(inspect.signature(fwd).parameters)
    except (TypeError, ValueError):
        return set()


def config_of(model: Any):
    inner = unwrap_module(model)
    return getattr(inner, "config", None) or getattr(getattr(inner, "backbone", None), "config", None)


def family_name(model: Any) -> str:
    """``model_type (ClassName)`` of a HF model (or a DeepSpeed engine / CriticLM around one), for messages."""
    return f"{getattr(config_of(model), 'model_type', None) or '?'} ({type(unwrap_module(model)).__name__})"


def text_config(model: Any):
    """The text part of ``model``'s config (a multimodal config's language model's, else the config itself)."""
    cfg = config_of(model)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def sequence_convolutions(model: Any) -> list[str]:
    """Modules convolving over the sequence (Mamba's, LFM2's short convolution, gated delta nets'): nn.Conv1d."""
    return [name for name, m in unwrap_module(model).named_modules() if isinstance(m, torch.nn.Conv1d)]


def probe_batch(vocab: int, device) -> tuple:
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


def vocab_size(model: Any) -> int:
    return int(getattr(text_config(model), "vocab_size", 0) or 32)


def device_of(model: Any):
    dev = getattr(model, "device", None)
    if isinstance(dev, (torch.device, str)):
        return dev
    return next(unwrap_module(model).parameters()).device


def output_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])


def reads_positions(model: Any, ids: torch.Tensor) -> bool:
    """Whether the output of ``ids`` (1, 3) at positions 0, 1, 2 differs from that at 0, 2, 4 (other distances: rotary
    embeddings ignore a mere shift). Bit-equal means the model counts positions itself, ignoring packing's ids."""
    n = ids.shape[1]
    pos = torch.arange(n, device=ids.device)[None]
    bounds = torch.tensor([0, n], dtype=torch.int32, device=ids.device)  # verl_ds_varlen_sdpa: one sequence
    kw = {"use_cache": False, "attention_mask": torch.ones_like(ids), "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
          "max_length_q": n, "max_length_k": n}
    first = output_of(model(input_ids=ids, position_ids=pos, **kw))
    return not torch.equal(first, output_of(model(input_ids=ids, position_ids=pos * 2, **kw)))


@contextlib.contextmanager
def probing(model: Any):
    """No grad, eval mode (no dropout: the position probe compares outputs bit for bit), the training flag restored."""
    inner = unwrap_module(model)
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        inner.train(was_training)
