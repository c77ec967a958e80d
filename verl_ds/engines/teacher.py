"""The on-policy distillation teacher (``distill.teacher_path``): a frozen HF causal LM built partitioned like the
reference, and the start-up check that it is one and shares the actor's tokenizer (a token id must mean the same
token to both, or the teacher scores other words than the student wrote)."""
from __future__ import annotations

import os
from typing import Optional

from verl_ds.config import Config, ConfigError, Derived

BASE = "base"  # distill.teacher_path: the LoRA actor's own base, adapters off
_KEY = "distill.teacher_path"


def _causal_lms() -> tuple[set, set]:
    """(model types, class names) AutoModelForCausalLM loads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    classes = {c for value in names.values() for c in (value if isinstance(value, (tuple, list)) else (value,))}
    return set(names), classes


def check_teacher(cfg: Config) -> None:
    """ConfigError naming ``distill.teacher_path`` when the teacher directory is missing, holds no causal LM, has no
    tokenizer files, or its vocabulary differs from the actor's (no cross-tokenizer alignment)."""
    path = cfg.distill.teacher_path
    if path is None or path == BASE:
        return
    from transformers import AutoConfig, AutoTokenizer

    from verl_ds.engines.build import load_tokenizer

    if not os.path.isdir(path):
        raise ConfigError(f"{_KEY}: {path!r} does not exist or is not a directory (expected a local HF causal-LM "
                          f"directory, or '{BASE}' with actor.lora_rank > 0)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # the HF message is long; ours names the key
        raise ConfigError(f"{_KEY}: {path!r} holds no readable HF model config ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    archs = list(getattr(config, "architectures", None) or [])
    types, classes = _causal_lms()
    if not (set(archs) & classes if archs else config.model_type in types):
        raise ConfigError(f"{_KEY}: {path!r} is not a causal LM (architectures {archs or None}, model_type "
                          f"{config.model_type!r}); the teacher must load with AutoModelForCausalLM (a reward or "
                          "value model scores sequences, not tokens)")
    try:
        teacher_tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ConfigError(f"{_KEY}: {path!r} has no usable tokenizer ({type(exc).__name__}); save the tokenizer "
                          "with the teacher (tokenizer.save_pretrained): the start-up compares it with the actor's"
                          ) from None
    student, teacher = load_tokenizer(cfg).get_vocab(), teacher_tok.get_vocab()
    if student != teacher:
        ids = [{i: t for t, i in v.items()} for v in (student, teacher)]
        first = min(i for i in set(ids[0]) | set(ids[1]) if ids[0].get(i) != ids[1].get(i))
        raise ConfigError(f"{_KEY}: the teacher's vocabulary ({len(teacher)} tokens) differs from the actor's "
                          f"({len(student)} tokens), e.g. id {first} is {ids[1].get(first)!r} to the teacher and "
                          f"{ids[0].get(first)!r} to the actor; on-policy distillation compares log-probs of the same "
                          "token ids, so the teacher must share the actor's tokenizer")


def build_teacher_engine(cfg: Config, derived: Derived, tok) -> Optional[object]:
    """The teacher's frozen engine (every rank calls it), partitioned as the reference; None when distillation is
    off or the teacher is the LoRA actor's base (the actor's own engine)."""
    path = cfg.distill.teacher_path
    if path is None or path == BASE:
        return None
    from transformers import AutoModelForCausalLM

    from verl_ds.engines.build import _dtype, check_vocab, disable_dropout, make_engine
    from verl_ds.engines.ds_config import make_ds_config, uses_gpu
    from verl_ds.weights.zero3 import has_partitioned_params, partitioned_construction

    with partitioned_construction(make_ds_config(cfg, derived, "ref", gpu=uses_gpu(cfg))):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(cfg))
    check_vocab(model, tok, "teacher")
    disable_dropout(model)
    return make_engine(model if has_partitioned_params(model) else model.to(_dtype(cfg)), cfg, derived, "ref")
