"""The one HF ``GenerationConfig`` every HF sampling path uses, so they all draw from the softmax(logits /
temperature) the trainer scores, truncated by top-k / top-p only. ``generate`` fills every None field from the
checkpoint's ``generation_config.json`` (``GenerationMixin._prepare_generation_config``), so each field with a
non-None neutral value is set here and ``generate`` runs inside ``only_this_generation_config``."""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterator, Optional

log = logging.getLogger(__name__)

# fields a checkpoint may set without changing what is drawn: special tokens (ours are passed), bookkeeping, and the
# knobs the rollout sets itself
_NOT_SAMPLING = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
                 "_from_model_config", "do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "use_cache",
                 "cache_implementation"}
_reported: set = set()


def rollout_generation_config(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float, greedy: bool,
                              pad_token_id: int, eos_token_id: int, bos_token_id: Optional[int]):
    """A complete ``GenerationConfig``: temperature, top-k (<= 0: off), top-p or greedy, everything else off."""
    from transformers import GenerationConfig

    return GenerationConfig(
        # top_k <= 0 disables it (our convention, as vLLM's -1); HF's TopKLogitsWarper refuses a negative k. Greedy
        # leaves it unset: argmax uses no warper, and transformers warns of any top_k but its default with do_sample off
        do_sample=not greedy, temperature=1.0 if greedy else float(temperature),
        top_k=None if greedy else max(int(top_k), 0), top_p=1.0 if greedy else float(top_p),
        typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, min_length=0, min_new_tokens=0,
        guidance_scale=1.0, renormalize_logits=False, remove_invalid_values=False,
        num_beams=1, num_return_sequences=1, return_dict_in_generate=False, output_scores=False,
        output_logits=False, output_attentions=False, output_hidden_states=False,
        max_new_tokens=int(max_new_tokens), pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        bos_token_id=bos_token_id, use_cache=True)


def checkpoint_sampling_fields(model: Any, gen_cfg) -> list[str]:
    """The fields ``model``'s generation config sets that would change what ``generate`` draws, stops at or returns."""
    own = getattr(model, "generation_config", None)
    if own is None:
        return []
    return sorted(k for k, v in own.to_diff_dict().items()
                  if k not in _NOT_SAMPLING and v != getattr(gen_cfg, k, None))


def _generating_module(model: Any) -> Any:
    """The module whose ``generate`` reads its own generation config: ``model``, or a peft model's base model."""
    if callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
        return model.get_base_model()
    return model


@contextlib.contextmanager
def only_this_generation_config(model: Any, gen_cfg) -> Iterator[None]:
    """While active, ``model``'s own generation config is a copy of ``gen_cfg`` (the ignored fields logged once)."""
    module = _generating_module(model)
    own = getattr(module, "generation_config", None)
    fields = tuple(checkpoint_sampling_fields(module, gen_cfg))
    if fields and fields not in _reported:
        _reported.add(fields)
        log.info("rollout: the model's generation config sets %s; not applied: every sampling path draws from "
                 "softmax(logits / rollout.temperature) with rollout.top_k / top_p only, the distribution the trainer "
                 "scores", ", ".join(fields))
    module.generation_config = copy.deepcopy(gen_cfg)
    try:
        yield
    finally:
        module.generation_config = own
