"""The critic: CriticLM (an LM backbone plus a scalar value head) and ValueModel (the BaseModel contract
around a CriticLM, a DeepSpeed engine wrapping one, or any callable ``fn(observation) -> Tensor``)."""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch
import torch.nn as nn

from verl_ds.models.base import TrainableRole, ValueRole, at_last_token, left_align_prompts, update_from_config
from verl_ds.rows import check_ids_and_mask, position_ids_from_mask
from verl_ds.state import SharedState

__all__ = ["CriticLM", "ValueModel", "VALUE_HEAD_FILE"]

VALUE_HEAD_FILE = "value_head.pt"


def _hidden_size(config) -> int:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(cfg.hidden_size)


class CriticLM(nn.Module):
    """HF backbone (``AutoModel``, no LM head) + ``value_head`` Linear(H, 1) -> (B, T) float32 values. The head starts
    at N(0, (0.02/sqrt(H))^2): initial values near 0 while the backbone still gets gradients from the first step."""

    def __init__(self, backbone: nn.Module, hidden_size: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.config = getattr(backbone, "config", None)  # HF/DeepSpeed integrations read model.config
        if hidden_size is None:
            if self.config is None:
                raise ValueError("CriticLM: pass hidden_size when the backbone has no HF config")
            hidden_size = _hidden_size(self.config)
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=0.02 / math.sqrt(hidden_size))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm_config(cls, config, **kwargs) -> "CriticLM":
        """A randomly initialised critic for a causal LM config (``AutoModel.from_config``)."""
        from transformers import AutoModel

        return cls(AutoModel.from_config(config, **kwargs))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "CriticLM":
        """Backbone from a causal LM or critic checkpoint; the value head from its ``value_head.pt``, else a new one."""
        from transformers import AutoModel

        if "torch_dtype" in kwargs:
            kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
        model = cls(AutoModel.from_pretrained(path, **kwargs))
        head = os.path.join(os.fspath(path), VALUE_HEAD_FILE)
        if os.path.isfile(head):
            model.value_head.load_state_dict(torch.load(head, map_location="cpu", weights_only=True))
            model.value_head.to(next(model.backbone.parameters()).dtype)
        return model

    def save_pretrained(self, path: str | os.PathLike, **kwargs) -> None:
        """The backbone in HF format plus ``value_head.pt``; ``from_pretrained`` reads both back."""
        self.backbone.save_pretrained(path, **kwargs)
        torch.save(self.value_head.state_dict(), os.path.join(os.fspath(path), VALUE_HEAD_FILE))

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        kwargs.setdefault("use_cache", False)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, T, H)
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()  # (B, T)


class ValueModel(ValueRole, TrainableRole):
    """The critic. ``net``: a CriticLM (or an engine around one), an nn.Module returning (B, T) values or ``.logits``
    (B, T, 1), or a callable ``fn(observation) -> (B,) or (B, T)``; (B, 1) is refused, never broadcast."""

    required_modules = ("net",)

    def __init__(self, net: nn.Module | Callable[[torch.Tensor], torch.Tensor], state: SharedState | None = None,
                 optimizer: torch.optim.Optimizer | None = None, lr_key: str = "critic_lr",
                 remove_padding: bool = False, sequence_parallel: Any = None):
        super().__init__(state=state, net=net)
        self._remove_padding = bool(remove_padding)  # a config switch, not state (never from a checkpoint)
        # a SequenceParallel group (verl_ds.models.sequence_parallel): packed rows split over its ranks
        self._sp = sequence_parallel
        if not callable(net):
            raise TypeError(f"ValueModel: net must be an nn.Module or a callable fn(observation) -> Tensor, got "
                            f"{type(net).__name__}")
        self._is_network = isinstance(net, nn.Module)
        self._optimizer = optimizer
        self.lr_key = lr_key

    def _raw(self, observation: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T = observation.shape
        if self._is_network:
            out = self.net(input_ids=observation, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask))
            if not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
                out = out.logits
                if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[-1] == 1:
                    out = out.squeeze(-1)  # token classifier with one label
            where = "the value network"
        else:
            where = f"the value function {getattr(self.net, '__name__', type(self.net).__name__)!r}"
            try:
                out = self.net(observation)
            except Exception as exc:  # a user callable: say which model and what it was given
                message = (f"ValueModel: {where} failed on observation of shape {tuple(observation.shape)} and "
                           f"dtype {observation.dtype} (token ids): {type(exc).__name__}: {exc}")
                try:  # keep the exception's type when it can be built from one message
                    err = type(exc)(message)
                except Exception:
                    err = RuntimeError(message)
                raise err from exc
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"ValueModel: {where} must return a Tensor, got {type(out).__name__}")
        if not out.dtype.is_floating_point:
            raise TypeError(f"ValueModel: {where} must return floating-point values, got dtype {out.dtype}")
        if out.dim() == 2 and out.shape == (B, 1) and T != 1:
            raise ValueError(f"ValueModel: {where} returned shape (B, 1) = {tuple(out.shape)}; return (B,) for a "
                             f"sequence value (squeeze the last dim: values.squeeze(-1)) or (B, T) = {(B, T)} for "
                             f"per-token values. (B, 1) would silently broadcast against (B, T) rewards.")
        if tuple(out.shape) not in ((B,), (B, T)):
            raise ValueError(f"ValueModel: {where} returned shape {tuple(out.shape)}; expected (B,) = ({B},) or "
                             f"(B, T) = {(B, T)}")
        out = out.float()
        if not self._is_network and not bool(torch.isfinite(out).all()):
            raise ValueError(f"ValueModel: {where} returned non-finite values (NaN or inf)")
        return out

    def get_value(self, observation: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) float32: the value at the last real token of each row (a (B,) output is taken as is)."""
        who = "ValueModel.get_value"
        observation, mask = check_ids_and_mask(observation, mask, who)
        values = self._raw(observation, mask)
        if values.dim() == 1:
            return values
        return at_last_token(values, mask)

    def get_values(self, observation: torch.Tensor, mask: torch.Tensor | None, response_length: int) -> torch.Tensor:
        """(B, R) float32 values[:, -R-1:-1]: the state before each response token (as verl's critic)."""
        who = "ValueModel.get_values"
        observation, mask = check_ids_and_mask(observation, mask, who)
        T = observation.shape[1]
        if isinstance(response_length, bool) or not isinstance(response_length, int) or not 1 <= response_length < T:
            raise ValueError(f"{who}: response_length (the response width R) must be an int with 1 <= R < T={T}, "
                             f"got {response_length!r}")
        if self._remove_padding and self._is_network:  # the real tokens only, packed in one row (verl_ds.packing)
            from verl_ds.models.packed_forward import packed_values
            from verl_ds.packing import pack

            return packed_values(self.net, pack(observation, mask, response_length), response_length,
                                 sequence_parallel=self._sp)
        if self._sp is not None:
            raise ValueError(f"{who}: sequence parallelism splits packed rows: it needs remove_padding=True and a "
                             f"network critic")
        observation, mask = left_align_prompts(observation, mask, response_length)  # values[:, -R-1]: the prompt's end
        values = self._raw(observation, mask)
        if values.dim() != 2:
            raise ValueError(f"{who}: per-token values need a (B, T) output; the value function returned "
                             f"{tuple(values.shape)} (a sequence value cannot be aligned with response tokens)")
        return values[:, -response_length - 1:-1]

    def update(self, batch: Any, config: Any):
        """One step from ``config["loss"]`` (``verl_ds.models.base.update_from_config``)."""
        return update_from_config(self, self.net, self._optimizer, config, "compute_value_loss",
                                  None if self._is_network else "a plain value function has no parameters to train")
