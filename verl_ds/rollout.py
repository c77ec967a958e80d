"""Rollout: sample responses from the actor with HF ``generate``.

Two ways to generate from a ZeRO-3 actor:
- ``gather_params=True`` (default): once per generate call the actor's sharded parameters are
  gathered into a resident full replica, and ``generate`` runs on it with no collectives per
  token (peers report ~10x faster generation than per-token gathering; ``benchmarks/e2e.py``
  measures both). It costs one full copy of the actor per rank: use it when the model fits.
- ``gather_params=False``: ``generate`` runs on the engine's module, gathering each layer's
  parameters at every token; ``synced_gpus=True`` keeps ranks that finish early stepping so a
  rank with shorter responses does not leave the others waiting forever in a collective.

The response mask comes from real lengths (up to and including the first EOS), never from
``token != pad``: pad == eos is common.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_ds.batch import RolloutBatch


@dataclass
class Generation:
    responses: torch.Tensor  # (B, R) int64, right-padded with pad_token_id
    response_length: torch.Tensor  # (B,) int64, EOS included
    done: torch.Tensor  # (B,) bool: ended with EOS


def gathered_state_dict(module: torch.nn.Module) -> dict:
    """Full (un-sharded) parameters and buffers of a ZeRO-3 (or plain) module as CPU tensors, on every rank."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    out = {}
    # remove_duplicate=False: a tied LM head (Qwen2.5-0.5B, ...) is its own key in the replica's state dict
    for name, param in module.named_parameters(remove_duplicate=False):
        with GatheredParameters([param], modifier_rank=None):
            out[name] = param.detach().to("cpu", copy=True)
    persistent = set(module.state_dict().keys())  # rotary caches etc. are non-persistent: not part of a checkpoint
    for name, buf in module.named_buffers():
        if name in persistent:
            out[name] = buf.detach().to("cpu", copy=True)
    return out


class Rollout:
    """Generates responses for left-padded prompts from the actor engine."""

    def __init__(self, actor_engine, tokenizer, gather_params: bool = True):
        self.engine = actor_engine
        self.tokenizer = tokenizer
        self.gather_params = gather_params
        self._replica = None

    def sync_replica(self) -> torch.nn.Module:
        """Refresh the resident full copy of the actor from its (possibly sharded) parameters."""
        module = self.engine.module
        state = gathered_state_dict(module)
        if self._replica is None:
            self._replica = empty_like(module, device=self.engine.device)
        self._replica.load_state_dict(state, strict=True)
        self._replica.eval()
        return self._replica

    @property
    def replica(self):
        return self._replica

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False) -> Generation:
        """Sample up to ``max_new_tokens`` per prompt; the result is always (B, max_new_tokens) wide."""
        from transformers import GenerationConfig

        tok = self.tokenizer
        if self.gather_params:
            model, synced = (self._replica if self._replica is not None else self.sync_replica()), False
        else:
            model = self.engine.module
            synced = dist.is_initialized() and dist.get_world_size() > 1
        # every knob explicit: a checkpoint's generation_config.json (top_k=20, repetition_penalty=1.05, ...)
        # must not silently truncate sampling, or the rollout distribution differs from the one the
        # trainer scores (the log-probs are those of the temperature-scaled, untruncated softmax)
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=1.0 if greedy else float(temperature),
            top_k=0 if greedy else int(top_k), top_p=1.0 if greedy else float(top_p), repetition_penalty=1.0,
            no_repeat_ngram_size=0, min_new_tokens=0, max_new_tokens=int(max_new_tokens),
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, use_cache=True)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask.long(),
                             generation_config=gen_cfg, synced_gpus=synced)
        responses = out[:, input_ids.shape[1]:]
        width = responses.shape[1]
        if width < max_new_tokens:
            pad = responses.new_full((responses.shape[0], max_new_tokens - width), tok.pad_token_id)
            responses = torch.cat([responses, pad], dim=1)
        lengths = RolloutBatch.response_length_from_eos(responses, tok.eos_token_id)
        done = (responses == tok.eos_token_id).any(dim=1)
        # positions after the first EOS hold whatever generate padded with; make them the pad id
        cols = torch.arange(max_new_tokens, device=responses.device).unsqueeze(0)
        responses = torch.where(cols < lengths.unsqueeze(1), responses, torch.full_like(responses, tok.pad_token_id))
        return Generation(responses=responses.long(), response_length=lengths, done=done)


def empty_like(module: torch.nn.Module, device=None) -> torch.nn.Module:
    """A plain (un-partitioned) model of the same architecture, built from its config, on ``device``."""
    config = copy.deepcopy(module.config)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # never let the replica build enter a ZeRO-3 collective
    except ImportError:
        pass
    with torch.random.fork_rng(devices=[]):  # weight init must not move the RNG: resume is exact
        replica = type(module)(config)
    dtype = next(module.parameters()).dtype
    return replica.to(dtype=dtype, device=device)
