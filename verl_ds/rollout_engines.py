"""Rollout engines: the sampler behind ``PolicyModel.get_action``, chosen with ``rollout.engine`` from a registry:
``hf`` (``verl_ds.generation.HFRolloutEngine``) or ``vllm`` (a colocated in-process engine per rank, docs/vllm.md).
Each has HF's contract: ``generate(...) -> verl_ds.generation.Generation`` and ``refresh()`` after each actor update
(a collective under ZeRO-3)."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

from verl_ds.algos.registry import Registry
from verl_ds.config import Config, ConfigError

log = logging.getLogger(__name__)

ROLLOUT_ENGINES = Registry("rollout engine", "engines")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_VLLM_KEYS = ("vllm_dtype", "vllm_gpu_memory_utilization", "vllm_kv_cache_bytes", "vllm_enforce_eager", "vllm_sleep")


def register_rollout_engine(name: str, *, check: Optional[Callable[[Config], None]] = None):
    """Register ``build(cfg, actor, tokenizer, *, state, rank, lora)`` and a ``check(cfg)`` raising ConfigError."""
    return ROLLOUT_ENGINES.register(name, check=check or (lambda cfg: None))


def check_rollout_engine(cfg: Config) -> None:
    """The configured engine's own checks (ConfigError naming the key); run before any model is built."""
    try:
        entry = ROLLOUT_ENGINES.entry(cfg.rollout.engine)
    except ValueError as exc:
        raise ConfigError(f"rollout.engine: {exc}") from None
    if entry.name != "vllm":
        defaults = type(cfg.rollout)()
        ignored = [k for k in _VLLM_KEYS if getattr(cfg.rollout, k) != getattr(defaults, k)]
        if ignored:
            log.warning("rollout.engine=%s: %s only apply to rollout.engine=vllm and are ignored", entry.name,
                        ", ".join(f"rollout.{k}" for k in ignored))
    entry.meta["check"](cfg)


def build_rollout_engine(cfg: Config, actor, tokenizer, *, state=None, rank: int = 0, lora=None,
                         engine: Optional[str] = None):
    """The engine ``engine`` (default: ``rollout.engine``) names, sampling from ``actor`` (a collective for vLLM)."""
    return ROLLOUT_ENGINES.get(engine or cfg.rollout.engine)(cfg, actor, tokenizer, state=state, rank=rank, lora=lora)


# ------------------------------------------------------------------------------------------------ hf


@register_rollout_engine("hf")
def build_hf(cfg: Config, actor, tokenizer, *, state=None, rank: int = 0, lora=None):
    """HF generate; with a LoRA actor the replica holds the merged weights (``verl_ds.weights.hf_weights``)."""
    from verl_ds.generation import HFRolloutEngine

    return HFRolloutEngine(actor, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id, gather_params=cfg.rollout.gather_params,
               share_prefill=cfg.rollout.share != "none", share_decode=cfg.rollout.share == "decode")


# ---------------------------------------------------------------------------------------------- vllm


def vllm_dtype(cfg: Config) -> str:
    """vLLM's dtype name for ``rollout.vllm_dtype`` (auto: ``model.dtype``)."""
    key = cfg.model.dtype if cfg.rollout.vllm_dtype == "auto" else cfg.rollout.vllm_dtype
    return VLLM_DTYPES[key]


def _head_dim(cfg: Config) -> tuple[Any, str]:
    """(the actor's config with hidden_size / num_attention_heads / head_dim, the keys it came from)."""
    from types import SimpleNamespace

    m = cfg.model
    if m.path is None:
        from verl_ds.config.model_fields import tiny_model_fields

        f = tiny_model_fields(cfg)
        return (SimpleNamespace(hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
                                head_dim=f.get("head_dim")),
                "model.config_overrides hidden_size / num_attention_heads")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(m.path)
    except Exception as exc:  # noqa: BLE001 - HF raises many kinds; ours names the key
        raise ConfigError(f"model.path: no usable config.json in {m.path!r} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text, f"model.path ({m.path})"


def check_vllm_config(cfg: Config) -> None:
    """vLLM importable, a full-weight actor, a head_dim vLLM's CPU attention supports, no sleep mode on CPU."""
    if cfg.actor.lora_rank > 0:
        raise ConfigError(f"rollout.engine=vllm: actor.lora_rank={cfg.actor.lora_rank} is not supported (vLLM would "
                          f"need the merged weights at every sync); use rollout.engine=hf with LoRA")
    from verl_ds.engines.vllm_engine import check_cpu_head_dim, import_vllm

    # in a training run vLLM's warnings are noise repeated at every step (no tokenizer, no rotary weights to
    # reload, thread binding): errors only, unless the user asks (VLLM_LOGGING_LEVEL=WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import_vllm()
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"rollout.engine=vllm: {exc}") from None
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        if cfg.rollout.vllm_sleep:
            raise ConfigError("rollout.vllm_sleep=true needs a GPU: vLLM's CPU worker has no sleep mode")
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        config, source = _head_dim(cfg)
        try:
            check_cpu_head_dim(config, CPUAttentionBackend.get_supported_head_sizes())
        except ValueError as exc:
            raise ConfigError(f"rollout.engine=vllm: {source}: {exc}") from None


class VLLMRollout:
    """HFRolloutEngine's contract on a colocated vLLM engine. Weights are synced again before ``generate`` when the
    actor's step count moved since the last sync (a checkpoint was loaded), so a resume never samples stale weights."""

    def __init__(self, actor, *, pad_token_id: int, eos_token_id: int, state=None, seed: int = 0, rank: int = 0,
                 dtype: str = "float32", gpu_memory_utilization: float = 0.5, kv_cache_bytes: Optional[int] = None,
                 enforce_eager: Optional[bool] = None, sleep: bool = False):
        from verl_ds.engines.vllm_engine import VLLMRolloutEngine, gathered_named_parameters

        self.lm, self.seeds = actor, CallSeeds(seed, rank, state)
        self.sleep_between, self._asleep = bool(sleep), False
        self.syncs = 0
        t0 = time.perf_counter()
        self.engine = VLLMRolloutEngine.from_hf_model(
            self.module, named_tensors=gathered_named_parameters(self.module), pad_token_id=pad_token_id,
            eos_token_id=eos_token_id, dtype=dtype, seed=self.seeds.engine_seed(),
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager, enable_sleep_mode=self.sleep_between)
        self.start_seconds = time.perf_counter() - t0
        self._synced_at = self._actor_steps()
        self._after_generate()

    @property
    def module(self) -> torch.nn.Module:
        return getattr(self.lm, "module", self.lm)

    @property
    def device(self):
        return getattr(self.lm, "device", None) or next(self.module.parameters()).device

    def _actor_steps(self):
        return getattr(self.lm, "global_steps", None)  # DeepSpeed's optimizer-step count, restored with a checkpoint

    def refresh(self) -> None:
        """Stream the actor's weights into vLLM one module at a time (a collective under ZeRO-3)."""
        from verl_ds.engines.vllm_engine import gathered_named_parameters

        self._wake()
        self.engine.sync_weights(gathered_named_parameters(self.module))
        self.syncs += 1
        self._synced_at = self._actor_steps()
        self._after_generate()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                 stop_token_ids: Sequence[int] = ()):
        """HFRolloutEngine.generate's contract (``entropy`` is None: vLLM does not report it)."""
        if self._synced_at != self._actor_steps():  # the actor's weights were replaced (a resume): sync first
            self.refresh()
        seed = self.seeds.next()
        self._wake()
        try:
            return self.engine.generate_padded(input_ids, attention_mask, max_new_tokens=int(max_new_tokens),
                                               temperature=float(temperature), top_k=max(int(top_k), 0),
                                               top_p=float(top_p), greedy=bool(greedy), seed=seed,
                                               stop_token_ids=list(stop_token_ids))
        finally:
            self._after_generate()

    def _wake(self) -> None:
        if self._asleep:
            self.engine.wake_up()
            self._asleep = False

    def _after_generate(self) -> None:
        if self.sleep_between and not self._asleep:  # the update phases get the KV cache's and weights' memory
            self.engine.sleep(level=1)
            self._asleep = True

    def close(self) -> None:
        """Shut the vLLM engine down (the trainer's process group stays)."""
        self.engine.close()


class CallSeeds:
    """Seeds from (trainer seed, global step, rank, call in the step): a resume repeats the uninterrupted seeds."""

    def __init__(self, seed: int, rank: int, state=None):
        self.seed, self.rank, self.state = int(seed), int(rank), state
        self._step, self._calls = None, 0

    def next(self) -> int:
        step = int(self.state.get("global_step")) if self.state is not None else 0
        if step != self._step:
            self._step, self._calls = step, 0
        self._calls += 1
        return mix_seed(self.seed, step, self.rank, self._calls - 1)

    def engine_seed(self) -> int:
        """vLLM's own start-up seed (it seeds numpy with it: < 2**32); sampling never uses it."""
        return mix_seed(self.seed, -1, self.rank, 0) % 2**31


def mix_seed(seed: int, step: int, rank: int, call: int) -> int:
    """A 63-bit seed from four ints (numpy's SeedSequence: nearby inputs give unrelated streams)."""
    import numpy as np

    entropy = [int(x) % 2**64 for x in (seed, step, rank, call)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]) >> 1


@register_rollout_engine("vllm", check=check_vllm_config)
def build_vllm(cfg: Config, actor, tokenizer, *, state=None, rank: int = 0, lora=None) -> VLLMRollout:
    if lora is not None:
        check_vllm_config(cfg)  # raises: LoRA is refused
    r = cfg.rollout
    return VLLMRollout(actor, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, state=state,
                       seed=cfg.trainer.seed, rank=rank, dtype=vllm_dtype(cfg),
                       gpu_memory_utilization=r.vllm_gpu_memory_utilization, kv_cache_bytes=r.vllm_kv_cache_bytes,
                       enforce_eager=r.vllm_enforce_eager, sleep=r.vllm_sleep)
