"""The actor and the frozen reference: a causal LM (a HF model or a DeepSpeed engine wrapping one).
``ReferenceModel`` scores log-probs; ``PolicyModel`` also samples (``get_action``) and trains (``update``)."""
from __future__ import annotations

from typing import Any

import torch

from verl_ds.algos.response_logprob import response_logprobs
from verl_ds.models.base import (ActionRole, LogProbRole, TrainableRole, forward_params, left_align_prompts,
                                 unwrap_module, update_from_config)
from verl_ds.rows import check_ids_and_mask, position_ids_from_mask
from verl_ds.state import SharedState

__all__ = ["PolicyModel", "ReferenceModel", "AdaptersOffReferenceModel", "active_dropout"]


def _check_sampling(temperature: float, top_k: int, top_p: float, who: str) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{who}: temperature must be a float > 0, got {temperature!r} (use top_k=1 for greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"{who}: top_k must be an int >= 0 (0 or -1 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"{who}: top_p must be in (0, 1] (1.0 disables it), got {top_p!r}")


def active_dropout(module: torch.nn.Module) -> list[str]:
    """Names of the submodules in training mode that drop units: an ``nn.Dropout`` with p > 0 (LoRA's included) or a
    float ``*dropout*`` rate > 0 (HF attention keeps its own)."""
    found = []
    for name, m in module.named_modules():
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            if m.p > 0:
                found.append(name)
        elif any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in vars(m).items()):
            found.append(name)
    return found


class ReferenceModel(LogProbRole):
    """Log-probs of responses under ``lm``, a HF causal LM or an engine around one (``.logits`` (B, T, V))."""

    required_modules = ("lm",)

    def __init__(self, lm: Any, state: SharedState | None = None, remove_padding: bool = False,
                 fused_lm_head: bool = False, share_prompts: bool = False, share_prefixes: bool = False,
                 sequence_parallel: Any = None):
        super().__init__(state=state, lm=lm)
        # a SequenceParallel group (verl_ds.models.sequence_parallel): packed rows split over its ranks
        self._sp = sequence_parallel
        if sequence_parallel is not None and not remove_padding:
            raise ValueError(f"{type(self).__name__}: sequence parallelism splits packed rows: it needs "
                             f"remove_padding=True")
        # run-time switches from the config, not state: private so a checkpoint never overrides them
        self._remove_padding, self._fused_lm_head = bool(remove_padding), bool(fused_lm_head)
        self._share_prompts = bool(share_prompts) and self._remove_padding  # a packed-row layout
        self._share_prefixes = bool(share_prefixes) and self._share_prompts  # and the responses' common prefixes
        if not callable(lm):
            raise TypeError(f"{type(self).__name__}: lm must be callable (a HF causal LM or a DeepSpeed engine), got "
                            f"{type(lm).__name__}")
        # Decided once here: which optional HF kwargs the wrapped model's forward accepts.
        params = forward_params(unwrap_module(lm))
        self._extra_kwargs = {"use_cache": False} if "use_cache" in params else {}
        self._keep_logits = "logits_to_keep" in params

    @property
    def shares_prompts(self) -> bool:
        """Whether scoring packs each prompt once for all its samples (``verl_ds.prompt_sharing``)."""
        return self._share_prompts

    # ---- forward ---------------------------------------------------------------------------------
    def _logits(self, observation: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
        """(B, keep, V): the lm's logits (or a fused head's output) at the last ``keep`` positions."""
        kwargs = dict(self._extra_kwargs)
        if self._keep_logits:
            kwargs["logits_to_keep"] = keep
        out = self.lm(input_ids=observation, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                      **kwargs)
        logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:1] != observation.shape[:1]:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"{type(self).__name__}: the lm must return logits of shape (B, T, V); got {got}")
        if logits.shape[1] < keep:
            raise ValueError(f"{type(self).__name__}: the lm returned logits for {logits.shape[1]} positions, need {keep}")
        return logits[:, -keep:]

    def get_logprob(self, observation: torch.Tensor, action: torch.Tensor, mask: torch.Tensor | None = None,
                    temperature: float = 1.0, return_entropy: bool = False, head_kl=None):
        """Log-probs (B, R) float32 of the response tokens ``action`` (B, R) = observation[:, -R:] at
        ``temperature``, differentiable; with return_entropy also the entropies (B, R). Padded response positions
        hold garbage: mask them. ``head_kl`` (``verl_ds.models.full_kl``): its column comes back last, (B, R)."""
        who = f"{type(self).__name__}.get_logprob"
        observation, mask = check_ids_and_mask(observation, mask, who)
        if not isinstance(action, torch.Tensor) or action.dim() != 2 or action.shape[0] != observation.shape[0]:
            got = tuple(action.shape) if isinstance(action, torch.Tensor) else type(action).__name__
            raise ValueError(f"{who}: action must be (B, R) = ({observation.shape[0]}, R) response ids, got {got}")
        R, T = action.shape[1], observation.shape[1]
        if not 1 <= R < T:
            raise ValueError(f"{who}: action width R={R} must satisfy 1 <= R < T={T} (the observation holds the "
                             f"prompt then the response)")
        if not torch.equal(action.long(), observation[:, -R:]):
            rows = (action.long() != observation[:, -R:]).any(-1).nonzero().flatten().tolist()
            raise ValueError(f"{who}: action must equal the last R={R} columns of observation; rows {rows} differ")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"{who}: temperature must be a float > 0, got {temperature!r}")
        if self._remove_padding:  # the real tokens only, packed in one row (verl_ds.packing)
            from verl_ds.models.packed_forward import packed_logprobs
            from verl_ds.packing import pack

            if self._share_prompts:  # one copy of each prompt for all its samples (verl_ds.prompt_sharing)
                from verl_ds.prompt_sharing import pack_shared_prompts

                packed = pack_shared_prompts(observation, mask, R, share_prefixes=self._share_prefixes)
            else:
                packed = pack(observation, mask, R)
            out = packed_logprobs(self.lm, packed, R, temperature, compute_entropy=return_entropy,
                                  fused_lm_head=self._fused_lm_head, head_kl=head_kl, sequence_parallel=self._sp)
            log_probs, entropy = out[:2]
        else:
            observation, mask = left_align_prompts(observation, mask, R)  # logits[:, -R-1] must be the prompt's last
            if self._fused_lm_head or head_kl is not None:
                out = self._fused_padded(observation, mask, action.long(), temperature, return_entropy, head_kl)
                log_probs, entropy = out[:2]
            else:  # (B, R+1, V): position t predicts response token t; read in place (no (B, R, V) copy for backward)
                log_probs, entropy = response_logprobs(self._logits(observation, mask, R + 1), action.long(),
                                                       temperature, compute_entropy=return_entropy)
        if head_kl is not None:
            return (log_probs, entropy, out[2]) if return_entropy else (log_probs, out[2])
        return (log_probs, entropy) if return_entropy else log_probs

    def _fused_padded(self, observation, mask, action, temperature, return_entropy, head_kl=None):
        """The LM head returns the last R + 1 positions' log-probs itself (no (B, R+1, V) logits)."""
        from verl_ds.models.packed_forward import lm_head_returns_logprobs

        B, R = action.shape
        labels = torch.cat([action, action.new_full((B, 1), -100)], 1).reshape(-1)
        with lm_head_returns_logprobs(self.lm, labels, temperature, return_entropy, head_kl=head_kl):
            out = self._logits(observation, mask, R + 1)  # (B, R+1, 1 to 3): [log-prob, entropy, head_kl]
        out = out.reshape(B, R + 1, -1)[:, :-1]
        lp_ent = out[..., 0], (out[..., 1] if return_entropy else None)
        return lp_ent if head_kl is None else (*lp_ent, out[..., -1])


class AdaptersOffReferenceModel(ReferenceModel):
    """A LoRA actor's reference: the actor's own engine with its adapters off while it scores (not concurrently)."""

    def __init__(self, lm: Any, state: SharedState | None = None, **kwargs):
        super().__init__(lm, state=state, **kwargs)
        inner = unwrap_module(lm)
        if not callable(getattr(inner, "disable_adapter", None)):
            raise TypeError(f"{type(self).__name__}: lm must be a peft model with LoRA adapters (or an engine around "
                            f"one), got {type(inner).__name__}")

    def get_logprob(self, *args, **kwargs):
        with unwrap_module(self.lm).disable_adapter():
            return super().get_logprob(*args, **kwargs)

    def torch_modules(self) -> list:
        """The modules holding the frozen base weights (what this model scores with)."""
        return [m for m in unwrap_module(self.lm).modules()
                if any(True for _ in m.parameters(recurse=False))
                and not any(p.requires_grad for p in m.parameters(recurse=False))]


class PolicyModel(ReferenceModel, ActionRole, TrainableRole):
    """The actor: scores like a ReferenceModel, samples through ``rollout_engine`` (default HF generate on ``lm``) and
    trains with ``update``; ``optimizer`` for an ``lm`` that is not an engine, ``lr_key`` its SharedState LR key."""

    def __init__(self, lm: Any, state: SharedState | None = None, optimizer: torch.optim.Optimizer | None = None,
                 lr_key: str = "actor_lr", rollout_engine: Any = None, tokenizer: Any = None,
                 remove_padding: bool = False, fused_lm_head: bool = False, share_prompts: bool = False,
                 share_prefixes: bool = False, sequence_parallel: Any = None):
        super().__init__(lm, state=state, remove_padding=remove_padding, fused_lm_head=fused_lm_head,
                         share_prompts=share_prompts, share_prefixes=share_prefixes,
                         sequence_parallel=sequence_parallel)
        self._optimizer = optimizer
        self.lr_key = lr_key
        self._rollout_engine = rollout_engine
        self._tokenizer = tokenizer

    @property
    def rollout_engine(self):
        """The sampler behind ``get_action`` (built on first use: HF generate on ``lm``)."""
        if self._rollout_engine is None:
            from verl_ds.generation import HFRolloutEngine

            ids = self._tokenizer if self._tokenizer is not None else unwrap_module(self.lm).config
            pad, eos = getattr(ids, "pad_token_id", None), getattr(ids, "eos_token_id", None)
            if pad is None or eos is None:
                raise ValueError("PolicyModel.get_action: the model config has no pad_token_id/eos_token_id; pass "
                                 "tokenizer= (or a rollout_engine) so responses can end and be padded")
            self._rollout_engine = HFRolloutEngine(self.lm, pad_token_id=pad, eos_token_id=eos,
                                                   bos_token_id=getattr(ids, "bos_token_id", None),
                                                   gather_params=False)
        return self._rollout_engine

    @property
    def update_forward_is_scoring_pass(self) -> bool:
        """Whether the update's forward computes what the no-grad ``get_logprob`` does (no dropout acts), so its
        detached log-probs are an on-policy update's old log-probs."""
        return not active_dropout(unwrap_module(self.lm))

    @torch.no_grad()
    def get_action(self, observation: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0,
                   top_k: int = 50, top_p: float = 0.95, *, max_new_tokens: int = 1, greedy: bool = False):
        """(action (B, R) int64 right-padded after EOS, log_probs, entropy (B, R) float32) for left-padded prompts,
        before top-k/top-p truncation: the distribution ``get_logprob`` recomputes (else the PPO ratio is biased)."""
        who = "PolicyModel.get_action"
        observation, mask = check_ids_and_mask(observation, mask, who)
        _check_sampling(temperature, top_k, top_p, who)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{who}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not bool(mask[:, -1].all()):
            rows = (~mask[:, -1]).nonzero().flatten().tolist()
            raise ValueError(f"{who}: the last column must be a real token in every row (left-pad the prompts); "
                             f"rows {rows} end with padding")
        gen = self.rollout_engine.generate(observation, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                           top_k=top_k, top_p=top_p, greedy=greedy)
        return gen.responses, gen.log_probs, gen.entropy

    def update(self, batch: Any, config: Any):
        """One step from ``config["loss"]`` (``verl_ds.models.base.update_from_config``)."""
        return update_from_config(self, self.lm, self._optimizer, config, "compute_policy_loss")
