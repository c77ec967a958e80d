"""RolloutBatch: the tensors of one PPO rollout, plus ``extras`` (per-sample non-tensor data, sliced and joined like
the tensors). Fields, aliases and checks: ``verl_ds.batch_layout`` and docs/batch.md."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from verl_ds.batch_layout import (DESIGN_FIELDS, EXTRA_FIELDS, FIELD_ALIASES, FIELDS, FLOAT_FIELDS, REQUIRED_FOR_LOSS,
                                  ROLLOUT_FIELDS, BatchValidationError, canonical as _canonical, check_layout,
                                  close_hint)

__all__ = ["RolloutBatch", "FIELDS", "DESIGN_FIELDS", "EXTRA_FIELDS", "REQUIRED_FOR_LOSS", "ROLLOUT_FIELDS",
           "BatchValidationError"]


def _slice_extra(value: Any, idx: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[idx.to(value.device)]
    if hasattr(value, "__array__") and hasattr(value, "shape"):  # numpy arrays
        return value[idx.cpu().numpy()]
    out = [value[i] for i in idx.tolist()]
    return type(value)(out) if isinstance(value, tuple) else out


class RolloutBatch:
    """Dict-like container of the ``batch_layout`` fields (unset: None); ``batch.x``, ``batch["x"]``, aliases too."""

    __slots__ = ("_data", "extras")

    def __init__(self, extras: dict[str, Sequence] | None = None, **fields: torch.Tensor | None):
        object.__setattr__(self, "_data", dict.fromkeys(FIELDS))
        object.__setattr__(self, "extras", dict(extras or {}))
        for name, value in fields.items():
            self[name] = value

    # ---- access -------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return object.__getattribute__(self, "_data")[_canonical(name)]

    def __setattr__(self, name: str, value) -> None:
        if name == "extras":
            if not isinstance(value, dict):
                raise TypeError(f"RolloutBatch.extras must be a dict, got {type(value).__name__}")
            object.__setattr__(self, name, value)
        else:
            self[name] = value

    def __getitem__(self, name: str) -> torch.Tensor | None:
        try:
            return self._data[_canonical(name)]
        except AttributeError as e:
            raise KeyError(str(e)) from None

    def __setitem__(self, name: str, value: torch.Tensor | None) -> None:
        name = _canonical(name)
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"RolloutBatch.{name} must be a torch.Tensor or None, got {type(value).__name__}")
        self._data[name] = value

    def __contains__(self, name: object) -> bool:
        name = FIELD_ALIASES.get(name, name) if isinstance(name, str) else name
        return name in FIELDS and self._data[name] is not None

    @classmethod
    def coerce(cls, batch: Any, who: str = "batch") -> "RolloutBatch":
        """A RolloutBatch as it is, or one built from a mapping of field name -> tensor (``extras`` allowed)."""
        if isinstance(batch, cls):
            return batch
        if isinstance(batch, Mapping):
            fields = {str(k): v for k, v in batch.items() if k != "extras"}
            unknown = [k for k in fields if FIELD_ALIASES.get(k, k) not in FIELDS]
            if unknown:
                raise BatchValidationError(unknown[0], f"{who} has unknown field(s) {unknown}{close_hint(unknown[0])} "
                                                       f"Fields: {list(FIELDS)}")
            for k, v in fields.items():
                if v is not None and not isinstance(v, torch.Tensor):
                    raise BatchValidationError(FIELD_ALIASES.get(k, k), f"{who}[{k!r}] must be a torch.Tensor, got "
                                                                   f"{type(v).__name__}")
            return cls(extras=dict(batch.get("extras") or {}), **fields)
        raise TypeError(f"{who} must be a RolloutBatch or a mapping of field name -> tensor (e.g. "
                        f"{{'observation': ..., 'mask': ...}}), got {type(batch).__name__}")

    def present(self) -> list[str]:
        """The fields that are set, in FIELDS order."""
        return [f for f in FIELDS if self._data[f] is not None]

    def items(self):
        return [(f, self._data[f]) for f in self.present()]

    def __len__(self) -> int:
        for f in FIELDS:
            if self._data[f] is not None:
                return int(self._data[f].shape[0]) if self._data[f].dim() > 0 else 0
        for v in self.extras.values():
            return len(v)
        return 0

    @property
    def prompt_width(self) -> int:
        """P = T - R."""
        return self.observation.shape[1] - self.response_width

    @property
    def response_width(self) -> int:
        """R, from action (or any (B, R) field)."""
        for f in ("action", "response_mask") + FLOAT_FIELDS:
            if self._data[f] is not None:
                return int(self._data[f].shape[1])
        raise BatchValidationError("action", "cannot tell the response width R: no (B, R) field is set")

    def __repr__(self) -> str:
        parts = [f"{f}={tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for f, t in self.items()]
        if self.extras:
            parts.append(f"extras={sorted(self.extras)}")
        return f"RolloutBatch({', '.join(parts)})"

    # ---- construction helpers ---------------------------------------------------------------------
    @staticmethod
    def response_length_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
        """(B,) int64: index of the first EOS + 1, or R when a row has no EOS (truncated)."""
        is_eos = response_ids == eos_token_id
        return torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, response_ids.shape[1]).to(torch.int64)

    @staticmethod
    def make_next_observation(observation: torch.Tensor, pad_token_id: int) -> torch.Tensor:
        """observation shifted left by one column with ``pad_token_id`` appended."""
        pad = torch.full_like(observation[:, :1], pad_token_id)
        return torch.cat([observation[:, 1:], pad], dim=1)

    @classmethod
    def from_generation(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_length: torch.Tensor | None = None, done: torch.Tensor | None = None, *,
                        pad_token_id: int, eos_token_id: int | None = None,
                        extras: dict | None = None) -> "RolloutBatch":
        """The ROLLOUT_FIELDS from left-padded prompts (B, P) and responses (B, R); without ``response_length`` and
        ``done``, they come from the first EOS."""
        if response_length is None:
            if eos_token_id is None:
                raise ValueError("from_generation: pass response_length or eos_token_id to find where responses end")
            response_length = cls.response_length_from_eos(response_ids, eos_token_id)
        response_length = response_length.to(device=response_ids.device, dtype=torch.int64)
        B, R = response_ids.shape
        if prompt_ids.shape[0] != B or prompt_mask.shape != prompt_ids.shape or response_length.shape != (B,):
            raise ValueError(f"from_generation: shapes disagree: prompt_ids {tuple(prompt_ids.shape)}, prompt_mask "
                             f"{tuple(prompt_mask.shape)}, response_ids {tuple(response_ids.shape)}, response_length "
                             f"{tuple(response_length.shape)}")
        response_mask = torch.arange(R, device=response_ids.device).unsqueeze(0) < response_length.unsqueeze(1)
        action = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_token_id)).to(torch.int64)
        prompt_mask = prompt_mask.bool()
        observation = torch.cat([prompt_ids.to(torch.int64), action], dim=1)
        if done is None:
            last = action.gather(1, (response_length - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            done = (last == eos_token_id) & (response_length > 0) if eos_token_id is not None else \
                torch.zeros(B, dtype=torch.bool, device=action.device)
        return cls(observation=observation, action=action, mask=torch.cat([prompt_mask, response_mask], dim=1),
                   response_mask=response_mask, prompt_length=prompt_mask.sum(-1).to(torch.int64),
                   response_length=response_length, done=done.to(torch.bool),
                   next_observation=cls.make_next_observation(observation, pad_token_id), extras=extras)

    def validate(self, pad_token_id: int, required: Iterable[str] = REQUIRED_FOR_LOSS) -> "RolloutBatch":
        """``batch_layout.check_layout``; returns self."""
        check_layout(self, pad_token_id, required)
        return self

    # ---- reshaping ------------------------------------------------------------------------------
    def select(self, indices: torch.Tensor | Sequence[int] | slice) -> "RolloutBatch":
        B = len(self)
        if isinstance(indices, slice):
            idx = torch.arange(B)[indices]
        else:
            idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < -B or int(idx.max()) >= B):
            raise IndexError(f"RolloutBatch.select: indices must be in [0, {B}), got min {int(idx.min())} "
                             f"max {int(idx.max())}")
        return self._map(lambda t: t[idx.to(t.device)], lambda v: _slice_extra(v, idx))

    def split(self, mini_batch_size: int, generator: torch.Generator | None = None,
              shuffle: bool = True) -> list["RolloutBatch"]:
        """Equal mini-batches, shuffled by whole ``group_index`` groups (rows in batch order, as verl splits), so that
        micro-batches hold whole groups and can share their prompts."""
        B = len(self)
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"split: mini_batch_size must be an int >= 1, got {mini_batch_size!r}")
        if B % mini_batch_size:
            raise ValueError(f"split: batch size {B} is not divisible by mini_batch_size {mini_batch_size}; "
                             f"mini-batches must be equal for the loss normalisation to be right")
        order = torch.arange(B)
        if shuffle:
            groups = self.group_index
            ids, inverse = torch.unique(groups.cpu(), return_inverse=True) if groups is not None else (None, None)
            if ids is not None and ids.numel() < B:
                # a random order of the groups; rows of a group stay adjacent, in batch order
                rank = torch.argsort(torch.randperm(ids.numel(), generator=generator))
                order = torch.sort(rank[inverse] * B + torch.arange(B)).indices
            else:
                order = torch.randperm(B, generator=generator)
        return [self.select(order[i:i + mini_batch_size]) for i in range(0, B, mini_batch_size)]

    @staticmethod
    def cat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Concatenate along B; all batches must set the same fields and extras with equal trailing shapes."""
        batches = list(batches)
        if not batches:
            raise ValueError("RolloutBatch.cat: got an empty list")
        first = batches[0]
        fields, keys = first.present(), set(first.extras)
        for n, b in enumerate(batches[1:], start=1):
            if b.present() != fields:
                diff = sorted(set(b.present()) ^ set(fields))
                raise ValueError(f"RolloutBatch.cat: batch {n} sets fields {b.present()}, batch 0 sets {fields} "
                                 f"(differ in {diff})")
            if set(b.extras) != keys:
                raise ValueError(f"RolloutBatch.cat: batch {n} has extras {sorted(b.extras)}, batch 0 has "
                                 f"{sorted(keys)}")
            for f in fields:
                if b._data[f].shape[1:] != first._data[f].shape[1:]:
                    raise ValueError(f"RolloutBatch.cat: field {f!r} of batch {n} has shape "
                                     f"{tuple(b._data[f].shape)}, batch 0 has {tuple(first._data[f].shape)} "
                                     f"(only the batch dimension may differ; pad to a common width first)")
        out = RolloutBatch()
        for f in fields:
            out._data[f] = torch.cat([b._data[f] for b in batches], dim=0)
        for k in first.extras:
            vals = [b.extras[k] for b in batches]
            if isinstance(vals[0], torch.Tensor):
                out.extras[k] = torch.cat(vals, dim=0)
            else:
                out.extras[k] = [x for v in vals for x in v]
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RolloutBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking),
                         lambda v: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)

    def clone(self) -> "RolloutBatch":
        return self._map(torch.clone, lambda v: v.clone() if isinstance(v, torch.Tensor) else list(v))

    def _map(self, field_fn, extra_fn) -> "RolloutBatch":
        out = RolloutBatch(extras={k: extra_fn(v) for k, v in self.extras.items()})
        for f, t in self.items():
            out._data[f] = field_fn(t)
        return out
