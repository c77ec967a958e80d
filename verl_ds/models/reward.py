"""RewardModel: a neural scorer and/or reward functions ``fn(prompts, responses, batch)`` returning (B,) scores
(placed on the last response token) or, with ``per_token=True``, (B, R) rewards, composed as a weighted sum. A
failure raises RewardFunctionError naming the function and the sample. LastTokenScorer also scores the RM job's loss.
"""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from verl_ds.models.base import RewardRole, at_last_token, unwrap_module
from verl_ds.rows import check_ids_and_mask, position_ids_from_mask
from verl_ds.state import SharedState
from verl_ds.verifiable import Scores

__all__ = ["RewardModel", "RewardFunctionError", "LastTokenScorer", "EOS_REWARD_MODES"]

EOS_REWARD_MODES = ("zero", "keep")


class RewardFunctionError(ValueError):
    """A reward function failed or returned something unusable; ``name`` and ``index`` say which/where."""

    def __init__(self, name: str, message: str, index: int | None = None):
        self.name, self.index = name, index
        where = f" (sample {index})" if index is not None else ""
        super().__init__(f"reward function {name!r}{where}: {message}")


@dataclass(frozen=True)
class _RewardFn:
    name: str
    fn: Callable
    weight: float
    per_token: bool


class LastTokenScorer:
    """A one-label classifier's (B,) float32 score at each row's last real token, for the RL reward and the RM loss.
    HF's pooling (``input_ids != pad_token_id``) drops a final EOS when pad == eos: a hook reads the head per token."""

    def __init__(self, model: nn.Module):
        self.model, self._slot = model, threading.local()  # thread-local: concurrent callers never share a capture
        head = getattr(unwrap_module(model), "score", None)
        self.hook = head.register_forward_hook(self._grab) if isinstance(head, nn.Module) else None

    def _grab(self, module, args, output):
        if getattr(self._slot, "active", False):
            self._slot.per_token = output

    def __call__(self, observation: torch.Tensor, mask: torch.Tensor, who: str) -> torch.Tensor:
        """``observation`` (B, T) int64, ``mask`` (B, T) bool, either padding side; position ids from the mask."""
        B, T = observation.shape
        self._slot.active, self._slot.per_token = True, None
        try:
            out = self.model(input_ids=observation, attention_mask=mask.long(),
                             position_ids=position_ids_from_mask(mask))
            per_token = self._slot.per_token
        finally:
            self._slot.active, self._slot.per_token = False, None
        scores = per_token if per_token is not None else (out.logits if hasattr(out, "logits") else out)
        if not isinstance(scores, torch.Tensor):
            raise TypeError(f"{who}: the scorer must return a Tensor or an output with .logits, got "
                            f"{type(scores).__name__}")
        if scores.dim() == 3 and scores.shape[-1] == 1:
            scores = scores.squeeze(-1)
        if scores.dim() == 3:
            raise ValueError(f"{who}: the scorer has {scores.shape[-1]} labels; a reward model needs num_labels=1")
        if tuple(scores.shape) == (B, T):
            scores = at_last_token(scores, mask)
        elif tuple(scores.shape) == (B, 1):
            scores = scores.squeeze(1)  # a pooled (B, num_labels=1) classifier output
        elif tuple(scores.shape) != (B,):
            raise ValueError(f"{who}: the scorer returned shape {tuple(scores.shape)}; expected (B, T) per-token, "
                             f"(B, 1) pooled or (B,) scores with B={B}, T={T}")
        return scores.float()

    def close(self) -> None:
        """Remove the hook (when the scorer is discarded but the model lives on)."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def _check_weight(weight: Any, who: str) -> float:
    from verl_ds.config.schema import MAX_REWARD_WEIGHT

    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(float(weight)) \
            or abs(float(weight)) > MAX_REWARD_WEIGHT:  # finite in float64 is not enough: the scores are float32
        raise ValueError(f"{who}: weight must be a finite float in [-{MAX_REWARD_WEIGHT:g}, {MAX_REWARD_WEIGHT:g}], "
                         f"got {weight!r}")
    return float(weight)


class RewardModel(RewardRole):
    """``model``: an optional neural scorer on the actor's vocabulary (a one-label HF classifier or an engine around
    one), read at each row's last real token; ``num_workers``: threads for slow reward functions."""

    required_modules = ()

    def __init__(self, model: nn.Module | None = None, tokenizer: Any = None, state: SharedState | None = None,
                 eos_reward: str = "zero", model_weight: float = 1.0, model_name: str = "reward_model",
                 micro_batch_size: int = 64, num_workers: int = 1):
        super().__init__(state=state, model=model)
        if model is not None and not callable(model):
            raise TypeError(f"RewardModel: model must be a sequence-classification nn.Module (or a DeepSpeed engine "
                            f"around one), got {type(model).__name__}")
        if eos_reward not in EOS_REWARD_MODES:
            raise ValueError(f"RewardModel: eos_reward must be one of {list(EOS_REWARD_MODES)}, got {eos_reward!r}")
        self.eos_reward = eos_reward
        self.model_weight = _check_weight(model_weight, "RewardModel")
        self.model_name = str(model_name)
        self._tokenizer = tokenizer
        for key, value in (("micro_batch_size", micro_batch_size), ("num_workers", num_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RewardModel: {key} must be an int >= 1, got {value!r}")
        self.micro_batch_size, self.num_workers = micro_batch_size, num_workers
        self._lock = threading.RLock()
        self._fns: tuple[_RewardFn, ...] = ()  # replaced, never mutated: compute_rewards reads one snapshot
        self._scorer = LastTokenScorer(model) if model is not None else None

    @property
    def tokenizer(self):
        return self._tokenizer

    def close(self) -> None:
        """Remove the capture hook from the scorer (when this RewardModel is discarded but the scorer lives on)."""
        if self._scorer is not None:
            self._scorer.close()

    # ---- functions -----------------------------------------------------------------------------------
    def register_reward_fn(self, fn: Callable, name: str | None = None, weight: float = 1.0,
                           per_token: bool = False) -> str:
        """Add ``fn`` (module docstring) under ``name`` (default ``fn.__name__``), replacing one of that name."""
        if not callable(fn):
            raise TypeError(f"register_reward_fn: fn must be callable, got {type(fn).__name__}")
        if not isinstance(per_token, bool):
            raise TypeError(f"register_reward_fn: per_token must be a bool, got {per_token!r}")
        weight = _check_weight(weight, "register_reward_fn")
        with self._lock:
            if name is None:
                name = getattr(fn, "__name__", type(fn).__name__)
                if name == "<lambda>":
                    name = f"lambda_{len(self._fns)}"
            if not isinstance(name, str) or not name or name == self.model_name:
                raise ValueError(f"register_reward_fn: name must be a non-empty str other than the scorer's "
                                 f"{self.model_name!r}, got {name!r}")
            entry = _RewardFn(name, fn, weight, per_token)
            fns = [f for f in self._fns if f.name != name]
            at = next((i for i, f in enumerate(self._fns) if f.name == name), len(fns))
            fns.insert(at, entry)
            self._fns = tuple(fns)
        return name

    def unregister_reward_fn(self, name: str) -> None:
        with self._lock:
            if name not in {f.name for f in self._fns}:
                raise KeyError(f"no reward function named {name!r}; registered: {[f.name for f in self._fns]}")
            self._fns = tuple(f for f in self._fns if f.name != name)

    def functions(self) -> list[tuple[str, Callable, bool]]:
        """(name, function, per_token) of the registered functions, in registration order."""
        return [(f.name, f.fn, f.per_token) for f in self._fns]

    def reward_fns(self) -> list[dict]:
        """[{"name", "weight", "per_token"}] in registration order."""
        return [{"name": f.name, "weight": f.weight, "per_token": f.per_token} for f in self._fns]

    # ---- neural scorer -------------------------------------------------------------------------------
    @torch.no_grad()
    def get_reward(self, observation: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) float32 scores of the neural scorer, ``micro_batch_size`` rows per forward."""
        who = "RewardModel.get_reward"
        if self.model is None:
            raise ValueError(f"{who}: this RewardModel has no neural scorer (only reward functions: "
                             f"{[f.name for f in self._fns]}); use compute_rewards")
        observation, mask = check_ids_and_mask(observation, mask, who)
        mb = self.micro_batch_size
        return torch.cat([self._scorer(observation[i:i + mb], mask[i:i + mb], who)
                          for i in range(0, observation.shape[0], mb)])

    # ---- composition ---------------------------------------------------------------------------------
    def compute_rewards(self, batch: Any, prompts: Sequence[str], responses: Sequence[str],
                        per_sample: Optional[dict] = None):
        """Token-level scores (B, R) float32 (batch-mode scores on column response_length - 1) and metrics
        ``reward/<name>/mean`` and ``reward/<name>/<key>`` (``Scores.metrics``); ``per_sample`` gets (B,) values."""
        who = "RewardModel.compute_rewards"
        fns = self._fns
        if self.model is None and not fns:
            raise ValueError(f"{who}: no reward source: pass a neural scorer (model=) or register a function "
                             f"with register_reward_fn")
        rl = batch.response_length
        if rl is None:
            raise ValueError(f"{who}: batch.response_length is required to place rewards")
        B, R = len(batch), batch.response_width
        if len(prompts) != B or len(responses) != B:
            raise ValueError(f"{who}: got {len(prompts)} prompts and {len(responses)} responses for a batch of {B}")
        if bool(((rl < 1) | (rl > R)).any()):
            i = int(((rl < 1) | (rl > R)).nonzero()[0])
            raise ValueError(f"{who}: batch.response_length[{i}] = {int(rl[i])} is outside [1, R={R}]")
        device = rl.device
        rows = torch.arange(B, device=device)
        valid = torch.arange(R, device=device).unsqueeze(0) < rl.unsqueeze(1)  # (B, R)
        total = torch.zeros(B, R, dtype=torch.float32, device=device)
        parts: dict[str, torch.Tensor] = {}  # metric name -> (B,) per-sample sums

        def place(seq_scores: torch.Tensor) -> torch.Tensor:
            mat = torch.zeros(B, R, dtype=torch.float32, device=device)
            mat[rows, rl - 1] = seq_scores.to(device)
            return mat

        if self.model is not None:
            mat = place(self.get_reward(batch.observation, batch.mask))
            total += self.model_weight * mat
            parts[f"reward/{self.model_name}/mean"] = mat.sum(-1)
        for entry in fns:
            raw = self._call_chunked(entry, list(prompts), list(responses), batch)
            if entry.per_token:
                mat = _to_token_scores(raw, entry.name, B, R, rl).to(device) * valid
                if self.eos_reward == "zero":
                    if batch.done is None:
                        raise ValueError(f"{who}: per-token reward {entry.name!r} with eos_reward='zero' needs "
                                         f"batch.done to find the EOS positions")
                    mat[rows[batch.done], (rl - 1)[batch.done]] = 0.0
            else:
                mat = place(_to_seq_scores(raw, entry.name, B))
            total += entry.weight * mat
            parts[f"reward/{entry.name}/mean"] = mat.sum(-1)
            for key, values in _side_metrics(raw, entry.name, B).items():
                parts[f"reward/{entry.name}/{key}"] = values.to(device)
        if per_sample is not None:
            per_sample.update(parts)
        return total, {k: v.mean() for k, v in parts.items()}

    def _call_chunked(self, entry: _RewardFn, prompts: list, responses: list, batch: Any) -> Any:
        """``entry.fn`` on the batch, or on ``num_workers`` contiguous chunks in a thread pool, joined in order."""
        B = len(prompts)
        workers = min(self.num_workers, B)
        if workers <= 1 or not hasattr(batch, "select"):
            return self._call(entry, prompts, responses, batch)
        from concurrent.futures import ThreadPoolExecutor

        bounds = [(B * k // workers, B * (k + 1) // workers) for k in range(workers)]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward") as pool:
            parts = list(pool.map(lambda lh: self._call(entry, prompts[lh[0]:lh[1]], responses[lh[0]:lh[1]],
                                                        batch.select(slice(lh[0], lh[1])), offset=lh[0]), bounds))
        out, side = [], {}
        for (lo, hi), part in zip(bounds, parts):
            for key, values in _side_metrics(part, entry.name, hi - lo).items():
                side.setdefault(key, []).append(values)
            if isinstance(part, torch.Tensor):
                part = list(part.unbind(0)) if part.dim() > 0 else [part]
            part = list(part) if not isinstance(part, (str, bytes)) and hasattr(part, "__iter__") else part
            if not isinstance(part, list) or len(part) != hi - lo:
                got = len(part) if isinstance(part, list) else type(part).__name__
                raise RewardFunctionError(entry.name, f"returned {got} value(s) for a chunk of {hi - lo} samples "
                                                      f"(rows {lo}..{hi - 1}); expected one per sample")
            out.extend(part)
        if side and len(next(iter(side.values()))) != len(parts):
            raise RewardFunctionError(entry.name, "returned side metrics for some chunks of the batch only")
        return Scores(out, {k: torch.cat(v).tolist() for k, v in side.items()}) if side else out

    @staticmethod
    def _call(entry: _RewardFn, prompts: list, responses: list, batch: Any, offset: int = 0) -> Any:
        try:
            return entry.fn(prompts, responses, batch)
        except (Exception, SystemExit) as e:  # locate the failing sample so the user can reproduce it
            index = None
            if hasattr(batch, "select"):
                for i in range(len(prompts)):
                    try:
                        entry.fn(prompts[i:i + 1], responses[i:i + 1], batch.select([i]))
                    except (Exception, SystemExit):
                        index = i
                        break
            hint = "" if index is not None else " (not reproducible on any single sample)"
            raise RewardFunctionError(entry.name, f"raised {type(e).__name__}: {e}{hint}",
                                      None if index is None else index + offset) from e

    # ---- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The public settings and the functions' names and weights (functions are code, re-registered on resume)."""
        out = super().state_dict()
        out["reward_fns"] = self.reward_fns()
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Restore the settings and the weights of functions registered under the same names."""
        sd = dict(sd)
        fns = {f["name"]: f for f in sd.pop("reward_fns", [])}
        if "model_weight" in sd:
            sd["model_weight"] = _check_weight(sd["model_weight"], "RewardModel.load_state_dict")
        if sd.get("eos_reward", self.eos_reward) not in EOS_REWARD_MODES:
            raise ValueError(f"RewardModel.load_state_dict: eos_reward must be one of {list(EOS_REWARD_MODES)}, "
                             f"got {sd['eos_reward']!r}")
        super().load_state_dict(sd)
        with self._lock:
            self._fns = tuple(_RewardFn(f.name, f.fn, _check_weight(fns[f.name]["weight"], f.name), f.per_token)
                              if f.name in fns else f for f in self._fns)


def _side_metrics(raw: Any, name: str, B: int) -> dict[str, torch.Tensor]:
    """{key: (B,) float32} of a function's ``Scores.metrics`` (per-sample values beside its scores), else {}."""
    if not isinstance(raw, Scores):
        return {}
    out = {}
    for key, values in raw.metrics.items():
        if not isinstance(key, str) or not key or "/" in key or not isinstance(values, (list, tuple)) \
                or len(values) != B:
            raise RewardFunctionError(name, f"side metric {key!r}: expected a name without '/' and a list of {B} "
                                            f"floats, one per sample")
        out[key] = _check_finite(torch.tensor([_number(x, name, i) for i, x in enumerate(values)],
                                              dtype=torch.float64).float(), f"{name} side metric {key!r}")
    return out


def _number(x: Any, name: str, index: int) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise RewardFunctionError(name, f"returned {type(x).__name__} {x!r}; expected a float", index)
    return float(x)


def _as_tensor(raw: Any, name: str) -> torch.Tensor | None:
    if isinstance(raw, torch.Tensor):
        t = raw
    elif hasattr(raw, "__array__") and hasattr(raw, "dtype") and hasattr(raw, "shape"):  # numpy
        t = torch.as_tensor(raw)
    else:
        return None
    if t.is_complex() or not (t.dtype.is_floating_point or t.dtype in (torch.int64, torch.int32, torch.int16,
                                                                      torch.int8, torch.uint8, torch.bool)):
        raise RewardFunctionError(name, f"returned a tensor of dtype {t.dtype}; expected real numbers")
    return t.detach().to(torch.float32)


def _check_finite(t: torch.Tensor, name: str) -> torch.Tensor:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        i = int(bad.reshape(t.shape[0], -1).any(-1).nonzero()[0])
        raise RewardFunctionError(name, f"returned a non-finite reward ({t[i].flatten()[bad[i].flatten()][0].item()})",
                                  i)
    return t


def _to_seq_scores(raw: Any, name: str, B: int) -> torch.Tensor:
    """(B,) float32 from a list/tuple/array/Tensor of B numbers."""
    t = _as_tensor(raw, name)
    if t is None:
        if not isinstance(raw, (list, tuple)):
            raise RewardFunctionError(name, f"returned {type(raw).__name__}; expected a list of {B} floats or a (B,) "
                                            f"tensor")
        if len(raw) != B:
            raise RewardFunctionError(name, f"returned {len(raw)} values for {B} samples; expected one per sample")
        t = torch.tensor([_number(x, name, i) for i, x in enumerate(raw)], dtype=torch.float64).float()
    if tuple(t.shape) == (B, 1) and B != 1:
        raise RewardFunctionError(name, f"returned shape (B, 1) = {tuple(t.shape)}; return (B,) (squeeze the last "
                                        f"dim), or register it with per_token=True for (B, R) rewards")
    if t.dim() != 1 or t.shape[0] != B:
        raise RewardFunctionError(name, f"returned shape {tuple(t.shape)}; expected ({B},), one value per sample")
    return _check_finite(t, name)


def _to_token_scores(raw: Any, name: str, B: int, R: int, rl: torch.Tensor) -> torch.Tensor:
    """(B, R) float32 from a (B, R) tensor/array or B sequences of response_length[i] (or R) numbers."""
    t = _as_tensor(raw, name)
    if t is None:
        if not isinstance(raw, (list, tuple)) or len(raw) != B:
            got = f"{len(raw)} rows" if isinstance(raw, (list, tuple)) else type(raw).__name__
            raise RewardFunctionError(name, f"per-token reward returned {got}; expected B={B} rows of per-token values")
        t = torch.zeros(B, R, dtype=torch.float32)
        for i, row in enumerate(raw):
            rt = _as_tensor(row, name)
            vals = rt.reshape(-1).tolist() if rt is not None else row
            if not isinstance(vals, (list, tuple)) or len(vals) not in (int(rl[i]), R):
                n = len(vals) if isinstance(vals, (list, tuple)) else type(vals).__name__
                raise RewardFunctionError(name, f"per-token row has {n} values; expected response_length="
                                                f"{int(rl[i])} or R={R}", i)
            t[i, :len(vals)] = torch.tensor([_number(x, name, i) for x in vals], dtype=torch.float64).float()
    if tuple(t.shape) != (B, R):
        raise RewardFunctionError(name, f"per-token reward returned shape {tuple(t.shape)}; expected (B, R) = "
                                        f"{(B, R)}")
    valid = torch.arange(R).unsqueeze(0) < rl.cpu().unsqueeze(1)
    return _check_finite(torch.where(valid, t, torch.zeros_like(t)), name)  # padding is dropped anyway
