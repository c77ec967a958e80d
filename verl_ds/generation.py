"""The HF rollout engine behind ``PolicyModel.get_action``: ``generate`` on a gathered replica of the actor (or on the
ZeRO-3 module under ``synced_gpus``) with every sampling knob explicit, returning each sampled token's log-prob and
entropy under softmax(logits / T); the n samples of a prompt share its prefill and their identical decoding states.
Why each choice, and which families get plain ``generate``: docs/models.md, "Generation"."""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from verl_ds.hf_module import (IGNORES_POSITIONS, device_of, family_name, forward_params, probe_batch, probing,
                                reads_positions, sequence_convolutions, unwrap_module, vocab_size)
from verl_ds.rows import position_ids_from_mask, prompt_groups
from verl_ds.sampling_config import only_this_generation_config, rollout_generation_config

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """Responses of one ``generate`` call; every tensor is (B, R) or (B,) with R = max_new_tokens."""
    responses: torch.Tensor  # (B, R) int64, right-padded with pad_token_id after each response's end
    response_length: torch.Tensor  # (B,) int64, EOS included
    done: torch.Tensor  # (B,) bool: ended with EOS
    log_probs: Optional[torch.Tensor] = None  # (B, R) float32 log p(token) under softmax(logits / T); 0 past the end
    entropy: Optional[torch.Tensor] = None  # (B, R) float32 entropy of that distribution; 0 past the end


class SampledTokenStats:
    """Logits processor recording each step's sampled-token log-prob and entropy under softmax(raw logits / T)."""

    def __init__(self, temperature: float, hook=None):
        self.inv_t = 1.0 / float(temperature)
        self.hook, self.versions = hook, []  # hook() -> the weights' version, once per step (asynchronous RL)
        self._prev: Optional[torch.Tensor] = None  # (B, V) log-softmax of the last step
        self.log_probs: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev is not None:  # the token drawn from the previous step's distribution is now the last id
            self.log_probs.append(self._prev.gather(1, input_ids[:, -1:]).squeeze(1))
        logp = torch.log_softmax(scores.float() * self.inv_t, dim=-1)
        self.entropy.append(-(logp.exp() * logp).sum(-1))
        self._prev = logp
        if self.hook is not None:  # these logits' weights; a weight update may land before the next forward
            self.versions.append(self.hook())
        return scores

    def finish(self, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_probs, entropy), each (B, R), for the R response columns ``generate`` returned."""
        R, k = responses.shape[1], len(self.log_probs)
        if self._prev is not None and k < len(self.entropy) and k < R:  # the last step's token
            self.log_probs.append(self._prev.gather(1, responses[:, k:k + 1]).squeeze(1))
        B = responses.shape[0]
        lp = torch.stack(self.log_probs[:R], dim=1) if self.log_probs else responses.new_zeros((B, 0), dtype=torch.float32)
        ent = torch.stack(self.entropy[:R], dim=1) if self.entropy else lp
        return lp, ent


class HFRolloutEngine:
    """HF ``generate`` on a causal LM or a DeepSpeed engine around one."""

    def __init__(self, lm, *, pad_token_id: int, eos_token_id: int, bos_token_id: Optional[int] = None,
                 gather_params: bool = True, share_prefill: bool = True, share_decode: bool = True):
        self.lm = lm
        self.pad_token_id, self.eos_token_id, self.bos_token_id = pad_token_id, eos_token_id, bos_token_id
        self.gather_params = gather_params
        if share_prefill:  # decided once, at start-up: hybrid models' caches do not follow rows (LFM2, Falcon-H1)
            why = shared_generation_refusal(self.lm)
            if why is not None:
                log.warning("rollout.share: %s; plain generate is used", why)
                share_prefill = False
        self.share_prefill = share_prefill
        self.share_decode = share_decode and share_prefill
        self._replica = None
        # verl_ds.asyncrl: step_hook() -> the weights' version at each decoding step; last_versions: thread -> its list
        self.step_hook, self.last_versions = None, {}

    @property
    def module(self):
        return getattr(self.lm, "module", self.lm)

    @property
    def device(self):
        return getattr(self.lm, "device", None) or next(self.module.parameters()).device

    def refresh(self) -> None:
        """Sync the replica to the actor after every update (collective under ZeRO-3; no-op without gather_params)."""
        if not self.gather_params:
            return
        from verl_ds.weights.replica import GenerationReplica

        if self._replica is None:  # built once, in the training dtype, on the engines' device
            self._replica = GenerationReplica(self.module, device=self.device)
        self._replica.refresh()

    @property
    def replica(self):
        return None if self._replica is None else self._replica.model

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                 stop_token_ids: Sequence[int] = ()) -> Generation:
        """Sample left-padded prompts into (B, max_new_tokens); a response ends, done and counted in its length, on EOS
        or any of ``stop_token_ids`` (an agent's turn end, e.g. Llama 3.1's <|eot_id|> and <|eom_id|>)."""
        from transformers import LogitsProcessorList

        if self.gather_params:
            if self._replica is None:
                self.refresh()
            model, synced = self._replica.model, False
        else:
            model = self.module
            synced = dist.is_initialized() and dist.get_world_size() > 1
        gen_cfg = rollout_generation_config(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
            pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id, bos_token_id=self.bos_token_id)
        stops = list(dict.fromkeys([int(self.eos_token_id), *map(int, stop_token_ids)]))
        if len(stops) > 1:
            gen_cfg.eos_token_id = stops  # generate stops on any of them and pads after it
        stats = SampledTokenStats(1.0 if greedy else temperature, self.step_hook)
        distinct = self.share_decode and not synced
        shared = shared_prefill(model, input_ids, attention_mask, expand=not distinct) if self.share_prefill and \
            not synced else None
        ids, mask = input_ids, attention_mask.long()
        if shared is not None:  # each row's first token from its prompt's logits; generate goes on from there
            first = sample_like_generate(shared.logits, input_ids, stats, gen_cfg)
            ids, mask = torch.cat([ids, first[:, None]], 1), torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
            gen_cfg.max_new_tokens = int(max_new_tokens) - 1
        if shared is not None and distinct:
            out = decode_distinct(model, shared, ids, mask, stats, gen_cfg)
        elif gen_cfg.max_new_tokens > 0:
            with only_this_generation_config(model, gen_cfg):  # nothing from the checkpoint's generation config
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                     logits_processor=LogitsProcessorList([stats]), synced_gpus=synced,
                                     **(shared.cache if shared is not None else {}))
        else:
            out = ids
        if not self.gather_params and hasattr(self.lm, "empty_partition_cache"):
            self.lm.empty_partition_cache()  # ZeRO-3 keeps every layer gathered after a direct module call
        responses = out[:, input_ids.shape[1]:]
        log_probs, entropy = stats.finish(responses)
        width = responses.shape[1]
        if width < max_new_tokens:  # every row stopped early: pad to the fixed width
            extra = max_new_tokens - width
            responses = torch.cat([responses, responses.new_full((responses.shape[0], extra), self.pad_token_id)], 1)
            log_probs = torch.cat([log_probs, log_probs.new_zeros((log_probs.shape[0], extra))], 1)
            entropy = torch.cat([entropy, entropy.new_zeros((entropy.shape[0], extra))], 1)
        if self.step_hook is not None:
            self.last_versions[threading.get_ident()] = stats.versions[:max_new_tokens]
        is_stop = torch.isin(responses, torch.tensor(stops, device=responses.device))
        lengths = torch.where(is_stop.any(-1), is_stop.int().argmax(-1) + 1, responses.shape[1]).to(torch.int64)
        done = is_stop.any(dim=1)
        # positions after the first EOS hold whatever generate padded with; make them the pad id
        valid = torch.arange(max_new_tokens, device=responses.device).unsqueeze(0) < lengths.unsqueeze(1)
        responses = torch.where(valid, responses, torch.full_like(responses, self.pad_token_id))
        zero = torch.zeros((), dtype=torch.float32, device=responses.device)
        return Generation(responses=responses.long(), response_length=lengths, done=done,
                          log_probs=torch.where(valid, log_probs.to(responses.device), zero),
                          entropy=torch.where(valid, entropy.to(responses.device), zero))


@dataclass
class SharedPrefill:
    """The prompt cache as a ``generate`` keyword, each row's next-token logits (B, V) float32, and ``rows`` (B,):
    each row's cache row (the identity once the cache is expanded to every row)."""
    cache: dict
    logits: torch.Tensor
    rows: torch.Tensor


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   expand: bool = True) -> Optional[SharedPrefill]:
    """Prefill each distinct prompt once, at ``generate``'s positions so the cache holds the keys it would compute.
    ``expand``: the cache copied to every batch row, for ``generate`` (None when no prompt repeats); else one row per
    distinct prompt, for ``decode_distinct``."""
    b = input_ids.shape[0]
    if b < 2 and expand:
        return None
    inverse, first = prompt_groups(input_ids, attention_mask)
    if first.numel() == b and expand:
        return None
    ids, mask = input_ids[first], attention_mask[first].long()
    positions = position_ids_from_mask(mask)
    params = forward_params(model)
    name = "cache" if "cache" in params else "past_key_values"  # transformers 5.24 says cache, 5.19 past_key_values
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # the next token's logits only
    from transformers import DynamicCache

    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{name: DynamicCache(config=model.config)}, **extra)
    cache = getattr(out, name, None)
    if cache is None:  # a model without a key/value cache: nothing to share, generate runs every row
        return None
    index = inverse.to(input_ids.device)
    if expand:
        cache.batch_select_indices(index)
    # generate's own copy: float32 logits of the last position (a prompt's last column is never padding: left pads)
    logits = out.logits[:, -1].to(dtype=torch.float32)[index]
    return SharedPrefill(cache={name: cache}, logits=logits,
                         rows=torch.arange(b, device=index.device) if expand else index)


@torch.no_grad()
def decode_distinct(model, prefill: SharedPrefill, ids: torch.Tensor, mask: torch.Tensor, stats: SampledTokenStats,
                    gen_cfg) -> torch.Tensor:
    """``generate``'s decoding loop, one forward row per distinct (prompt, tokens so far) state. ``ids``: (B, W + 1),
    the prompts and each row's first token; returns (B, W + 1 + steps) as ``generate`` does, pad after each EOS."""
    (name, cache), = prefill.cache.items()
    pad, B, dev = int(gen_cfg.pad_token_id), ids.shape[0], ids.device
    stops = gen_cfg.eos_token_id if isinstance(gen_cfg.eos_token_id, list) else [gen_cfg.eos_token_id]
    eos = torch.tensor([int(i) for i in stops], device=dev)
    state = prefill.rows.to(dev)  # each row's row in the cache: its prompt's, then its distinct state's
    held = int(state.max()) + 1  # rows in the cache: the distinct prompts, then the last step's states
    alive = ~torch.isin(ids[:, -1], eos)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in forward_params(model) else {}
    for _ in range(int(gen_cfg.max_new_tokens)):
        if not bool(alive.any()):
            break
        live = alive.nonzero().flatten()
        # a state and its last token are the next state: one forward row per distinct pair among the live rows
        key = torch.stack([state[live], ids[live, -1]], 1)
        pairs, inverse = torch.unique(key, dim=0, return_inverse=True)
        parents, tokens = pairs[:, 0], pairs[:, 1]
        if parents.numel() != held or not torch.equal(parents, torch.arange(held, device=dev)):
            cache.batch_select_indices(parents)  # rows split or finished: the cache follows (a copy)
        held = parents.numel()
        first_row = torch.full((pairs.shape[0],), B, device=dev).scatter_reduce(0, inverse, live, "amin")
        m = mask[first_row]  # the rows of a state share their mask (the same prompt, all live tokens real)
        positions = m.sum(-1, keepdim=True) - 1
        out = model(input_ids=tokens[:, None], attention_mask=m, position_ids=positions, use_cache=True,
                    **{name: cache}, **extra)
        cache = getattr(out, name)
        logits = out.logits[:, -1].to(dtype=torch.float32)
        state = torch.zeros(B, dtype=torch.long, device=dev).index_copy_(0, live, inverse)
        # every row draws, as generate draws all rows at once (a finished row's draw is replaced by the pad)
        nxt = sample_like_generate(logits[state], ids, stats, gen_cfg)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, pad))
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, mask.new_ones((B, 1))], 1)
        alive = alive & ~torch.isin(nxt, eos)
    return ids


def sample_like_generate(logits: torch.Tensor, input_ids: torch.Tensor, stats: SampledTokenStats,
                         gen_cfg) -> torch.Tensor:
    """(B,) next tokens from float32 ``logits`` (B, V), drawn as one step of HF ``generate`` draws them: ``stats``, the
    temperature/top-k/top-p warpers in ``GenerationMixin._get_logits_processor``'s order, then one
    ``torch.multinomial`` over all rows (the same random numbers), or argmax."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = stats(input_ids, logits)
    if not gen_cfg.do_sample:
        return torch.argmax(scores, dim=-1)
    warpers = []
    if gen_cfg.temperature is not None and gen_cfg.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(gen_cfg.temperature))
    if gen_cfg.top_k is not None and gen_cfg.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=gen_cfg.top_k, min_tokens_to_keep=1))
    if gen_cfg.top_p is not None and gen_cfg.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=gen_cfg.top_p, min_tokens_to_keep=1))
    for warp in warpers:
        scores = warp(input_ids, scores)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)


_GENERATION_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF module -> refusal or None


def shared_generation_refusal(model: Any) -> Optional[str]:
    """``_shared_generation_refusal``, probed once per model."""
    inner = unwrap_module(model)
    if inner not in _GENERATION_DECISIONS:
        _GENERATION_DECISIONS[inner] = _shared_generation_refusal(model)
    return _GENERATION_DECISIONS[inner]


def _shared_generation_refusal(model: Any) -> Optional[str]:
    """Why shared prefill/decoding cannot run on ``model`` (None when it can): a cache with state-space, convolution or
    linear-attention state does not follow row copies, and a model counting positions itself ignores each row's own.
    Runs tiny no-grad forwards (on every rank under ZeRO-3)."""
    family = family_name(model)
    convs = sequence_convolutions(model)
    if convs:
        return f"{family} has layers that carry a state along the sequence ({convs[0]}), not only a key/value cache"
    try:
        with probing(model):
            reads = reads_positions(model, probe_batch(vocab_size(model), device_of(model))[0][:1, :3])
    except Exception as exc:  # noqa: BLE001
        return f"{family}: a probe forward failed ({type(exc).__name__}: {exc})"
    finally:
        if callable(getattr(model, "empty_partition_cache", None)):
            model.empty_partition_cache()  # ZeRO-3 keeps the layers gathered after a direct module call
    if not reads:  # shared decoding gives each row the positions of its own prompt + response
        return f"{family}: {IGNORES_POSITIONS}"
    try:
        with probing(model):
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
    """Shared prefill, then ``generate`` and ``decode_distinct``, on three tiny rows: raises where a family's cache
    cannot be shared (DeepSeek-V4's). Only that they run; tests/models/test_families.py checks the tokens."""
    from transformers import GenerationConfig

    inner = unwrap_module(model)
    obs, mask, _ = probe_batch(vocab_size(model), device_of(model))
    ids, mask = obs[1:, :3], mask[1:, :3].long()  # prompt a twice (no pad), prompt b (one pad)
    ids, mask = torch.cat([ids[:1], ids], 0), torch.cat([mask[:1], mask], 0)
    # an end id outside the vocabulary: no row ends
    config = GenerationConfig(do_sample=False, max_new_tokens=1, num_beams=1, pad_token_id=0,
                              eos_token_id=vocab_size(model), use_cache=True)
    for expand in (True, False):
        pre = shared_prefill(inner, ids, mask, expand=expand)
        if pre is None:  # no cache to share: the engine runs plain generate for it anyway
            continue
        first = pre.logits.argmax(-1)
        ids1, mask1 = torch.cat([ids, first[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        with only_this_generation_config(inner, config):  # a checkpoint's stop_strings must not fail the probe
            if expand:
                inner.generate(input_ids=ids1, attention_mask=mask1, generation_config=config, **pre.cache)
            else:
                decode_distinct(inner, pre, ids1, mask1, SampledTokenStats(1.0), config)
