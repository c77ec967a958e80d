"""LoRA adapters through ``peft`` (Hu et al. 2021, https://arxiv.org/abs/2106.09685; https://huggingface.co/docs/peft):
only the adapters train, on a frozen base, and the reference is the actor with its adapters off, not a second model.
"""
from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from verl_ds.config import ConfigError
from verl_ds.weights.zero3 import gathered

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"  # peft's shorthand: every Linear/Conv1D layer except the output (LM) head
OUTPUT_HEAD = "output-head"  # the output (LM) head, whatever its name, when it is not tied to the input embedding
ADAPTER_NAME = "default"
LORA_SEED_OFFSET = {"actor": 101, "critic": 102}  # adapter init seeds: model.init_seed + offset, fixed per role


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings of one role (``actor.lora_*``; the critic's rank is ``critic.lora_rank``)."""
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple
    who: str = "actor"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_spec(cfg, who: str) -> Optional[LoraSpec]:
    """``who``'s LoraSpec, or None when its ``lora_rank`` is 0. The critic takes the actor's alpha, dropout and
    targets (one set of LoRA arguments, as OpenRLHF) less ``output-head``: its value head always trains whole."""
    rank = int(getattr(getattr(cfg, who), "lora_rank", 0) or 0)
    if rank == 0:
        return None
    a = cfg.actor
    targets = tuple(a.lora_target_modules)  # [] is refused when resolved
    if who == "critic":
        targets = tuple(t for t in targets if t != OUTPUT_HEAD)
        if not targets:
            raise ConfigError(f"critic.lora_rank={rank}: the critic's adapters go on actor.lora_target_modules less "
                              f"'{OUTPUT_HEAD}', and {list(a.lora_target_modules)} leaves none; add module names "
                              f"or '{ALL_LINEAR}' to actor.lora_target_modules (or set critic.lora_rank=0)")
    return LoraSpec(rank=rank, alpha=float(a.lora_alpha), dropout=float(a.lora_dropout), target_modules=targets,
                    who=who)


def _require_peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("actor.lora_rank/critic.lora_rank > 0 needs the peft package: pip install 'verl_ds[lora]' "
                          "(or pip install peft)") from None
    return peft


def is_peft_model(module) -> bool:
    module = getattr(module, "module", module)
    return callable(getattr(module, "get_base_model", None)) and hasattr(module, "peft_config")


def adaptable_module_names(model: torch.nn.Module) -> list:
    """Dotted names of the modules LoRA can wrap here (Linear, Conv1D, Embedding), in model order."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    return [name for name, m in model.named_modules() if name and isinstance(m, kinds)]


def resolve_target_modules(model: torch.nn.Module, targets, who: str) -> list:
    """Names (or dotted suffixes) for peft: ``all-linear`` is every Linear/Conv1D but the output head (peft's meaning),
    ``output-head`` the untied head; an unmatched or tied name is a ConfigError naming the key and close names."""
    key = "actor.lora_target_modules" + (" (the critic's adapters)" if who == "critic" else "")
    targets = list(targets)
    if not targets:
        raise ConfigError(f"{key}: expected at least one module name (or ['{ALL_LINEAR}']), got []")
    names = adaptable_module_names(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    tied = _tied_modules(model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    out = []
    if ALL_LINEAR in targets:
        from transformers.pytorch_utils import Conv1D

        out += sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                       if isinstance(m, (torch.nn.Linear, Conv1D)) and n and n != head_name})
    if OUTPUT_HEAD in targets:
        if head_name is None:
            raise ConfigError(f"{key}: '{OUTPUT_HEAD}': the {who} model has no output head (get_output_embeddings() "
                              "is None); leave it out")
        if head_name in tied:
            log.warning("%s: the output head %r is tied to %s (tie_word_embeddings): it gets no adapters", key,
                        head_name, tied[head_name])
        else:
            out.append(head_name)
    for target in targets:
        if target in (ALL_LINEAR, OUTPUT_HEAD):
            continue
        matched = [n for n in names if n == target or n.endswith("." + target)]
        if not matched:
            close = difflib.get_close_matches(target, leaves, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"{key}: no module named {target!r} in the {who} model{hint} (its adaptable modules: "
                              f"{', '.join(leaves)}; or use '{ALL_LINEAR}', '{OUTPUT_HEAD}')")
        for n in matched:
            if n in tied:
                raise ConfigError(f"{key}: {target!r} matches {n!r}, whose weight is tied to {tied[n]} "
                                  "(tie_word_embeddings); an adapter there cannot be merged into a plain model: "
                                  "leave it out")
        out.append(target)
    out = list(dict.fromkeys(out))
    if not out:
        raise ConfigError(f"{key}: {targets} leaves no module to adapt in the {who} model")
    return out


def _tied_modules(model: torch.nn.Module) -> dict:
    """{module name: [the other modules sharing its weight]} for weights held by more than one module."""
    owners: dict = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")  # its own parameter (a peft wrapper's .weight is its base layer's)
        if weight is not None:
            owners.setdefault(id(weight), []).append(name)
    return {n: [o for o in group if o != n] for group in owners.values() if len(group) > 1 for n in group}


def check_fused_head(peft_model) -> None:
    """ConfigError when the LM head itself has adapters: the fused LM head (``model.fused_lm_head``) computes
    log-probs from the head's weight, which would silently skip the adapter's delta."""
    head = peft_model.get_output_embeddings() if hasattr(peft_model, "get_output_embeddings") else None
    if isinstance(head, _lora_layer_class()):
        raise ConfigError("model.fused_lm_head=true reads the LM head's weight directly, but actor.lora_target_modules "
                          "gives the LM head adapters (their update would be skipped): leave the head out of "
                          "actor.lora_target_modules or set model.fused_lm_head=false")


class GradOnlyDropout(torch.nn.Dropout):
    """LoRA dropout under grad only: the no-grad rollout, old and reference passes must score one function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if torch.is_grad_enabled() else x


def apply_lora(model: torch.nn.Module, spec: LoraSpec, seed: int, task_type: Optional[str] = "CAUSAL_LM"):
    """``model`` wrapped by ``peft.get_peft_model`` with ``spec``'s adapters, base frozen. A and B start as peft's
    default (B = 0: exactly the base model), drawn under a forked RNG seeded by ``seed``: the same on every rank."""
    peft = _require_peft()
    targets = resolve_target_modules(model, spec.target_modules, spec.who)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                             bias="none", task_type=task_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        except ValueError as exc:  # e.g. a target of a kind LoRA cannot wrap
            raise ConfigError(f"actor.lora_target_modules={list(spec.target_modules)}: peft refused them: "
                              f"{str(exc).splitlines()[0]}") from None
    LoraLayer = _lora_layer_class()
    tied = _tied_modules(wrapped)
    for name, module in wrapped.named_modules():  # a suffix may also have matched a tied module
        if isinstance(module, LoraLayer) and f"{name}.base_layer" in tied:
            raise ConfigError(f"actor.lora_target_modules={list(spec.target_modules)} adapts {name!r}, whose "
                              f"weight is tied to {tied[f'{name}.base_layer']}: an adapter there cannot be merged "
                              "into a plain model; leave it out")
    for module in wrapped.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for name, d in list(dropouts.items()):
                if isinstance(d, torch.nn.Dropout):
                    dropouts[name] = GradOnlyDropout(d.p)
    return wrapped


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, full sizes under ZeRO-3."""
    trainable = total = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def adapters_off(module):
    """A context in which the peft model under ``module`` (an engine or the model) runs as its base model."""
    module = getattr(module, "module", module)
    if not is_peft_model(module):
        raise TypeError(f"adapters_off: expected a peft model (or an engine around one), got {type(module).__name__}")
    return module.disable_adapter()


def _lora_layer_class():
    from peft.tuners.lora import LoraLayer

    return LoraLayer


# ---------------------------------------------------------------------------------------- adapter export


@torch.no_grad()
def adapter_state_dict(peft_model) -> dict:
    """The adapters' weights gathered whole, under the names peft saves (only meaningful on rank 0; collective)."""
    from peft.utils import get_peft_model_state_dict

    named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    sd = {}
    for name, param in named:
        with gathered([param]):
            sd[name] = param.detach().to("cpu").clone()
    return get_peft_model_state_dict(peft_model, state_dict=sd, save_embedding_layers=False)
