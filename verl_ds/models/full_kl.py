"""``algo.kl_kind=full_symmetric`` in the actor's loss: the exact symmetric KL over the vocabulary at each response
position without (N, V) logits. The reference's final hidden states are recomputed in the actor's row layout, and the
actor's fused head adds the KL as one more column in its own module call (ZeRO-3 gathers the head for both passes).
"""
from __future__ import annotations

from typing import Any

import torch

from verl_ds.algos.full_kl import head_symmetric_kl

__all__ = ["RefHeadRows", "HeadSymmetricKL", "logprobs_with_full_kl"]


def _frozen(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    # a ZeRO-3 parameter's gathered storage is released (and reused) after the module call: keep a copy
    return t.detach().clone() if hasattr(t, "ds_id") else t.detach()


class RefHeadRows:
    """``head_kl`` of the reference's pass: its LM head records its input rows and weights and scores nothing."""

    replaces_head = True

    def __init__(self):
        self.hidden = self.weight = self.bias = None

    def __call__(self, head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden.detach()
        self.weight, self.bias = _frozen(head.weight), _frozen(getattr(head, "bias", None))
        return hidden.new_zeros(hidden.shape[0], 3, dtype=torch.float32)  # [log-prob, entropy, kl] unused


class HeadSymmetricKL:
    """``head_kl`` of the actor's pass: the full symmetric KL of each row against ``ref``'s rows."""

    replaces_head = False

    def __init__(self, ref: RefHeadRows, temperature: float):
        self.ref, self.temperature = ref, temperature

    def __call__(self, head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        ref = self.ref
        if ref.hidden is None or ref.hidden.shape[0] != hidden.shape[0]:
            got = None if ref.hidden is None else ref.hidden.shape[0]
            raise ValueError(f"full_symmetric KL: the reference's LM head saw {got} rows, the actor's {hidden.shape[0]}: "
                             f"the two models must score the micro-batch in the same layout")
        return head_symmetric_kl(hidden, head.weight, ref.hidden.to(hidden.dtype), ref.weight.to(hidden.dtype),
                                 bias=getattr(head, "bias", None), temperature=self.temperature,
                                 ref_bias=None if ref.bias is None else ref.bias.to(hidden.dtype))


_LAYOUT = ("_remove_padding", "_share_prompts", "_share_prefixes", "_sp")  # _sp: the same sequence-parallel group


def logprobs_with_full_kl(actor: Any, ref: Any, observation: torch.Tensor, action: torch.Tensor,
                          mask: torch.Tensor, temperature: float):
    """(log_probs, entropy, kl), each (B, R) float32 with grad into the actor: ``actor.get_logprob`` (through the
    fused LM head) and the exact 0.5 (KL(pi||ref) + KL(ref||pi)) over the vocabulary at each response position."""
    layout = {k: getattr(actor, k, None) for k in _LAYOUT}
    ref_layout = {k: getattr(ref, k, None) for k in _LAYOUT}
    if layout != ref_layout:
        raise ValueError(f"full_symmetric KL: the actor and the reference must pack micro-batches alike, got "
                         f"{layout} and {ref_layout}")
    rows = RefHeadRows()
    with torch.no_grad():
        ref.get_logprob(observation, action, mask, temperature, head_kl=rows)
    return actor.get_logprob(observation, action, mask, temperature, return_entropy=True,
                             head_kl=HeadSymmetricKL(rows, temperature))
