"""vLLM as the rollout engine: one colocated, in-process vLLM engine per rank (tensor parallel size 1). New weights
stream in from memory one module at a time; samples come back with untruncated log-probs, log softmax(logits / T),
from a wrap of the V1 sampler's top-k/top-p step. docs/vllm.md has the details.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
import weakref
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

import torch

from verl_ds.engines.vllm_process import (TESTED_VLLM, check_cpu_head_dim, import_vllm, keep_default_process_group,
                                          preserved_process_state)
from verl_ds.weights.zero3 import gathered, is_partitioned

__all__ = ["VLLMRolloutEngine", "VLLMGeneration", "gathered_named_parameters", "import_vllm", "check_cpu_head_dim"]

CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20  # on CPU gpu_memory_utilization is a fraction of host RAM: size it explicitly
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VLLMGeneration(NamedTuple):
    """One ``generate`` call; rows are prompt-major (prompt i's n samples are rows i*n .. i*n+n-1)."""
    responses: torch.Tensor  # (B, R) int64, right-padded with pad_token_id after each response's end
    response_length: torch.Tensor  # (B,) int64, EOS included
    done: torch.Tensor  # (B,) bool: ended with EOS
    log_probs: torch.Tensor  # (B, R) float32 log p(token) under softmax(logits / T), untruncated; 0 past the end


def _install_untruncated_logprobs(worker) -> bool:
    """Run in the worker (``collective_rpc``): the V1 sampler's top-k/top-p step reports log softmax of the
    temperature-scaled logits it receives, computed before it masks them in place. False if not found."""
    sampler = getattr(getattr(worker, "model_runner", None), "sampler", None)
    step = getattr(sampler, "topk_topp_sampler", None)
    if step is None or not callable(getattr(step, "forward", None)):
        return False
    if getattr(step, "_verl_ds_untruncated", False):
        return True
    masked_forward = step.forward

    def forward(logits, *args, **kwargs):
        full = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = masked_forward(logits, *args, **kwargs)
        return sampled, full

    step.forward = forward
    step._verl_ds_untruncated = True
    return True


def _row_seeds(entropy, rows: int) -> list[int]:
    """Distinct 31-bit per-row seeds (a SeedSequence: seeds s and s+1 share no stream)."""
    import numpy as np

    return [int(x) >> 1 for x in np.random.SeedSequence(entropy).generate_state(rows, dtype=np.uint32)]


class VLLMRolloutEngine:
    """A colocated vLLM engine, one per process at a time, from an HF model directory (or ``from_hf_model``)."""

    _live: Optional[weakref.ref] = None  # the engine of this process, if any

    def __init__(self, model_dir: str, *, pad_token_id: Optional[int] = None, eos_token_id=None,
                 dtype: str = "float32", seed: int = 0, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.5, kv_cache_memory_bytes: Optional[int] = None,
                 enforce_eager: Optional[bool] = None, enable_sleep_mode: bool = False,
                 load_format: str = "auto", **engine_kwargs):
        """model_dir: an HF model directory (weights unless load_format="dummy"); pad/eos ids default to its config's.
        On CPU kv_cache_memory_bytes defaults to 256 MiB and enforce_eager to True (slow compiled start-up)."""
        vllm = import_vllm()
        from transformers import AutoConfig

        from vllm.platforms import current_platform

        if isinstance(dtype, torch.dtype):
            dtype = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))
        if dtype not in DTYPES:
            raise ValueError(f"VLLMRolloutEngine: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        cfg = AutoConfig.from_pretrained(model_dir)
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            check_cpu_head_dim(cfg, CPUAttentionBackend.get_supported_head_sizes())
            kv_cache_memory_bytes = kv_cache_memory_bytes or CPU_DEFAULT_KV_CACHE_BYTES
            enforce_eager = True if enforce_eager is None else enforce_eager
            if enable_sleep_mode:
                raise ValueError("VLLMRolloutEngine: enable_sleep_mode needs a GPU (vLLM's CPU worker has no sleep)")
        eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos or not all(isinstance(e, int) for e in eos):
            raise ValueError(f"VLLMRolloutEngine: eos_token_id must be an int or a list of ints (from the argument "
                             f"or the model config), found {eos_token_id!r} / config {cfg.eos_token_id!r}")
        pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
        self.eos_token_ids, self.eos_token_id = eos, eos[0]
        self.pad_token_id = eos[0] if pad is None else int(pad)
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.seed, self._calls = int(seed), 0
        self._accepted, self._required = _expected_parameters(cfg)
        self._weights_whole = True
        self._made_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=self.seed,
                      max_model_len=self.max_model_len, logprobs_mode="processed_logprobs",
                      generation_config="vllm",  # never let a checkpoint's generation_config.json change sampling
                      gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
                      enforce_eager=bool(enforce_eager), load_format=load_format, tensor_parallel_size=1)
        if enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(engine_kwargs)
        live = VLLMRolloutEngine._live() if VLLMRolloutEngine._live is not None else None
        if live is not None and live.llm is not None:
            raise RuntimeError("VLLMRolloutEngine: one engine per process at a time (vLLM keeps its parallel state in "
                               "module globals, and shutting one engine down would break the other); close() the "
                               "existing engine first")
        t0 = time.perf_counter()
        with preserved_process_state():
            self.llm = vllm.LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self.untruncated_logprobs = all(self.llm.collective_rpc(_install_untruncated_logprobs))
        self._tmp = None
        VLLMRolloutEngine._live = weakref.ref(self)

    @classmethod
    def from_hf_model(cls, model, named_tensors: Optional[Iterable] = None, **kwargs) -> "VLLMRolloutEngine":
        """An engine for an in-memory HF causal LM: its config in a temporary directory, dummy weights, then
        ``sync_weights(named_tensors)`` (default ``model.named_parameters()``; gathered ones under ZeRO-3)."""
        tmp = tempfile.TemporaryDirectory(prefix="verl_ds_vllm_")
        model.config.save_pretrained(tmp.name)
        kwargs.setdefault("dtype", {v: k for k, v in DTYPES.items()}.get(model.dtype, "float32"))
        try:
            engine = cls(tmp.name, load_format="dummy", **kwargs)
        except BaseException:
            tmp.cleanup()
            raise
        engine._tmp = tmp
        try:
            engine.sync_weights(model.named_parameters() if named_tensors is None else named_tensors)
        except BaseException:
            engine.close()
            raise
        return engine

    def sync_weights(self, named_tensors: Iterable, strict: bool = True) -> float:
        """Stream (HF name, tensor) pairs into vLLM, a module's parameters together and valid until the next module's
        (vLLM buffers a layer until complete); strict: all must come. Returns the seconds taken. A bad pair raises
        after the reload, and ``generate`` refuses the mixed weights until a complete sync succeeds."""
        t0 = time.perf_counter()
        seen: set[str] = set()
        problems: list[BaseException] = []

        def checked():
            try:
                for item in named_tensors:
                    name, tensor = self._check_weight(item)
                    seen.add(name)
                    yield name, tensor.detach()
            except Exception as exc:  # stop here: raising inside vLLM's loader would leave layers on the meta device
                problems.append(exc)

        self._weights_whole = False
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checked(),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        if problems:
            raise problems[0]
        missing = sorted(self._required - seen)
        if strict and missing:
            raise ValueError(f"sync_weights: {len(missing)} parameters were not given, e.g. {missing[:3]}; the "
                             f"engine now mixes old and new weights (pass strict=False for a partial update)")
        self._weights_whole = True
        return time.perf_counter() - t0

    def _check_weight(self, item) -> tuple[str, torch.Tensor]:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"sync_weights: expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        shape = self._accepted.get(name)
        if shape is None:
            close = [k for k in self._accepted if k.endswith(str(name).split(".", 1)[-1])][:3]
            raise ValueError(f"sync_weights: {name!r} is not a parameter of this model (HF checkpoint names such "
                             f"as 'model.layers.0.self_attn.q_proj.weight' expected; closest: {close})")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"sync_weights: {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if not tensor.is_floating_point():
            raise ValueError(f"sync_weights: {name!r} has dtype {tensor.dtype}, expected a floating dtype")
        return name, tensor

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, n: int = 1, greedy: bool = False,
                 seed: Optional[int] = None, stop_token_ids: Sequence[int] = ()) -> VLLMGeneration:
        """``n`` samples of up to ``max_new_tokens`` per prompt (token-id lists): len(prompts) * n rows. ``seed`` fixes
        them (None: the engine's counter, never the global RNG); ``stop_token_ids`` end a response, for this call."""
        prompts = self._check_generate(prompt_token_ids, max_new_tokens, temperature, top_k, top_p, n, greedy, seed)
        from vllm import SamplingParams

        entropy = [self.seed, self._calls, 1] if seed is None else int(seed)
        self._calls += seed is None
        rows = len(prompts) * n
        stops = list(dict.fromkeys([*self.eos_token_ids, *map(int, stop_token_ids)]))
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=0.0 if greedy else float(temperature),
                                 top_k=0 if greedy else int(top_k), top_p=1.0 if greedy else float(top_p),
                                 min_p=0.0, logprobs=0, stop_token_ids=stops, seed=s, detokenize=False)
                  for s in _row_seeds(entropy, rows)]
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(n)]
        with preserved_process_state():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses = torch.full((rows, max_new_tokens), self.pad_token_id, dtype=torch.int64)
        log_probs = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(rows, dtype=torch.int64)
        done = torch.zeros(rows, dtype=torch.bool)
        eos = set(stops)
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
            toks = list(comp.token_ids)[:max_new_tokens]
            k = len(toks)
            responses[i, :k] = torch.tensor(toks, dtype=torch.int64)
            log_probs[i, :k] = torch.tensor([comp.logprobs[t][tok].logprob for t, tok in enumerate(toks)])
            lengths[i], done[i] = k, bool(k and toks[-1] in eos)
        return VLLMGeneration(responses, lengths, done, log_probs)

    def generate_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        """``HFRolloutEngine.generate``'s contract: left-padded (B, P) prompts in, a ``verl_ds.generation.Generation``
        out (entropy None: vLLM does not report it), tensors on the prompts' device."""
        from verl_ds.generation import Generation

        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(f"generate_padded: input_ids and attention_mask must both be (B, P), got "
                             f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
        ids, mask = input_ids.cpu().tolist(), attention_mask.bool().cpu().tolist()
        gen = self.generate([[t for t, m in zip(r, mr) if m] for r, mr in zip(ids, mask)], **kwargs)
        dev = input_ids.device
        return Generation(responses=gen.responses.to(dev), response_length=gen.response_length.to(dev),
                          done=gen.done.to(dev), log_probs=gen.log_probs.to(dev), entropy=None)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2) between rollouts; GPU with enable_sleep_mode."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down and remove its temporary directory, keeping a default process group that existed
        before it (vLLM's shutdown destroys it). Call it: garbage collection shuts down without this guard."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.ExitStack() as stack:
                if not self._made_process_group:
                    stack.enter_context(keep_default_process_group())
                llm.llm_engine.engine_core.shutdown()
            del llm
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_generate(self, prompts, max_new_tokens, temperature, top_k, top_p, n, greedy, seed):
        who = "VLLMRolloutEngine.generate"
        if self.llm is None:
            raise RuntimeError(f"{who}: the engine is closed")
        if not self._weights_whole:
            raise RuntimeError(f"{who}: the last sync_weights failed part-way, so the engine mixes old and new "
                               f"weights; sync a complete set first")
        for name, v, lo in (("max_new_tokens", max_new_tokens, 1), ("n", n, 1), ("top_k", top_k, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{who}: {name} must be an int >= {lo}, got {v!r}")
        if not greedy and not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"{who}: temperature must be > 0 when sampling, got {temperature!r} (use greedy=True)")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"{who}: top_p must be in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"{who}: seed must be None or an int >= 0, got {seed!r}")
        if not greedy and (top_k or top_p < 1) and not self.untruncated_logprobs:
            raise RuntimeError(f"{who}: top-k/top-p sampling needs the untruncated log-prob wrap, which this vLLM "
                               f"does not allow (tested with {TESTED_VLLM}); sample with top_k=0, top_p=1.0")
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"{who}: prompt_token_ids must be a non-empty list of token-id lists, got "
                             f"{type(prompts).__name__}")
        out = []
        for i, p in enumerate(prompts):
            p = p.tolist() if isinstance(p, torch.Tensor) else p
            if not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, int) and 0 <= t < self.vocab_size
                                                                    for t in p):
                raise ValueError(f"{who}: prompt {i} must be a non-empty list of ints in [0, {self.vocab_size}), "
                                 f"got {str(p)[:80]}")
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(f"{who}: prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that "
                                 f"exceeds max_model_len={self.max_model_len}")
            out.append(p)
        return out


def gathered_named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) per parameter, gathered one submodule at a time (a collective: drain it on every rank)
    and cloned: vLLM keeps a fused layer's tensors (q/k/v -> qkv_proj) while DeepSpeed frees each gather."""
    for prefix, sub in module.named_modules():
        params = list(sub.named_parameters(recurse=False))
        with gathered([p for _, p in params]):
            for name, p in params:
                yield (f"{prefix}.{name}" if prefix else name), (p.data.clone() if is_partitioned(p) else p.data)


def _expected_parameters(config) -> tuple[dict[str, tuple], set[str]]:
    """({HF name: shape} with tied aliases, the names that must come) of a config's causal LM on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    accepted = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    return accepted, {name for name, _ in model.named_parameters()}
