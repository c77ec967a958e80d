"""BaseModel and the role contracts of the design's six methods. Hot hyper-parameters live in ``self._state`` (a
SharedState the trainer and the control plane change) and are read at call time, never kept in attributes.
"""
from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn as nn

from verl_ds.hf_module import forward_params, unwrap_module  # noqa: F401 (this module's API too)
from verl_ds.registry import register_model_class
from verl_ds.state import SharedState

__all__ = ["BaseModel", "MissingModuleError", "ActionRole", "LogProbRole", "ValueRole", "RewardRole", "TrainableRole",
           "left_align_prompts", "unwrap_module",
           "forward_params", "optimizer_step", "update_from_config"]


class MissingModuleError(ValueError):
    """A required module was not given (or was None)."""


def _describe(v: Any) -> str:
    return "None" if v is None else type(v).__name__


def _is_abstract(cls: type) -> bool:
    # ABCMeta computes __abstractmethods__ only after __init_subclass__ has run, so look it up by hand.
    names = set()
    for base in cls.__mro__[1:]:
        names |= set(getattr(base, "__abstractmethods__", ()))
    names |= {n for n, v in vars(cls).items() if getattr(v, "__isabstractmethod__", False)}
    return any(getattr(getattr(cls, n, None), "__isabstractmethod__", False) for n in names)


def left_align_prompts(observation: torch.Tensor, mask: torch.Tensor,
                       response_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(observation, mask) with each row's prompt padding moved left, the last R columns untouched: response token
    j's predictor is then column T - R - 1 + j, never a pad (positions count real tokens: outputs are unchanged)."""
    P = observation.shape[1] - response_width
    if P < 1 or bool(mask[:, P - 1].all()):
        return observation, mask
    order = torch.sort(mask[:, :P].long(), dim=1, stable=True).indices  # pads first, real tokens in their order
    prompt_ids, prompt_mask = observation[:, :P].gather(1, order), mask[:, :P].gather(1, order)
    return torch.cat([prompt_ids, observation[:, P:]], 1), torch.cat([prompt_mask, mask[:, P:]], 1)


def at_last_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) ``values`` (B, T) at the last True column of each row of the (B, T) bool mask: left or right padding."""
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)
    return values.gather(1, last.long().unsqueeze(1)).squeeze(1)


class BaseModel(ABC):
    """A model component: subclasses set ``required_modules`` and ``module_types`` (name -> class) and call
    ``super().__init__(state=..., **modules)`` first; the modules become attributes, concrete classes are registered."""

    required_modules: ClassVar[tuple[str, ...]] = ()
    module_types: ClassVar[dict[str, type | tuple[type, ...]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not _is_abstract(cls):
            register_model_class(cls)

    def __init__(self, state: SharedState | None = None, **modules: Any):
        name = type(self).__name__
        given = ", ".join(f"{k}={_describe(v)}" for k, v in modules.items()) or "nothing"
        for req in self.required_modules:
            if modules.get(req) is None:
                raise MissingModuleError(f"Missing required module: {req} ({name} was given: {given})")
        for key, value in modules.items():
            kind = self.module_types.get(key)
            if value is not None and kind is not None and not isinstance(value, kind):
                want = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                raise TypeError(f"{name}: module {key!r} must be a {want}, got {type(value).__name__}")
        if state is not None and not isinstance(state, SharedState):
            raise TypeError(f"{name}: state must be a SharedState, got {type(state).__name__}")
        self._state = state if state is not None else SharedState()
        self._module_names = frozenset(modules)
        for key, value in modules.items():
            if not isinstance(getattr(type(self), key, None), property):  # properties: the subclass stores it
                setattr(self, key, value)

    @property
    def state(self) -> SharedState:
        return self._state

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every attribute not starting with ``_`` (the design's rule: what must survive a checkpoint is public),
        but module slots, nn.Modules and nested BaseModels: their weights belong to the engine checkpoints."""
        out = {}
        for key, value in vars(self).items():
            if key.startswith("_") or key in self._module_names or isinstance(value, (nn.Module, BaseModel)):
                continue
            if isinstance(value, torch.Tensor):
                out[key] = value.detach().clone()
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                out[key] = dataclasses.asdict(value)
            elif hasattr(value, "state_dict") and callable(value.state_dict):
                out[key] = value.state_dict()
            elif isinstance(value, (bool, int, float, str, list, tuple, dict, type(None))):
                out[key] = copy.deepcopy(value)
            else:
                raise TypeError(f"{type(self).__name__}.state_dict: public attribute {key!r} holds a "
                                f"{type(value).__name__}, which cannot be saved in a checkpoint; make it private "
                                f"(self._{key}) or give it state_dict()/load_state_dict()")
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Restore the keys present in ``sd`` of what ``state_dict()`` returned."""
        if not isinstance(sd, dict):
            raise TypeError(f"{type(self).__name__}.load_state_dict expects a dict, got {type(sd).__name__}")
        known = self.state_dict()
        for key, value in sd.items():
            # only what state_dict saves: never a method, a property or a module slot (setattr would replace it)
            if key not in known:
                raise KeyError(f"{type(self).__name__}.load_state_dict: unknown key {key!r}; "
                               f"known: {sorted(known)}")
            current = getattr(self, key)
            if isinstance(current, torch.Tensor):
                setattr(self, key, torch.as_tensor(value).to(device=current.device, dtype=current.dtype).clone())
            elif dataclasses.is_dataclass(current) and not isinstance(current, type):
                setattr(self, key, type(current)(**value))
            elif hasattr(current, "load_state_dict") and not isinstance(current, nn.Module):
                current.load_state_dict(value)
            else:
                setattr(self, key, copy.deepcopy(value))

    def torch_modules(self) -> list[nn.Module]:
        """The nn.Modules this component holds (directly or through nested BaseModels)."""
        out = []
        for key, value in vars(self).items():
            if isinstance(value, nn.Module):
                out.append(value)
            elif isinstance(value, BaseModel):
                out.extend(value.torch_modules())
        return out


# ---- the role contracts (the design's methods, each on the roles that can honour it) ---------------------


class ActionRole(BaseModel):
    """Samples actions (an LM policy: response tokens) with their log-probs and entropies."""

    @abstractmethod
    def get_action(self, observation: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0,
                   top_k: int = 50, top_p: float = 0.95, **kwargs):
        """(action, log_probs, entropy); no_grad and thread-safe."""


class LogProbRole(BaseModel):
    @abstractmethod
    def get_logprob(self, observation: torch.Tensor, action: torch.Tensor, mask: torch.Tensor | None = None,
                    temperature: float = 1.0, return_entropy: bool = False):
        """Log-probs (B, R) of ``action`` given ``observation``."""


class ValueRole(BaseModel):
    @abstractmethod
    def get_value(self, observation: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) value of each observation."""


class RewardRole(BaseModel):
    @abstractmethod
    def get_reward(self, observation: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) reward of each observation."""


class TrainableRole(BaseModel):
    """Updated in place from a batch; hot state is read from and written to ``self._state``."""

    @abstractmethod
    def update(self, batch: Any, config: Any):
        """One in-place update from ``batch``."""


def update_from_config(model: "BaseModel", module: Any, optimizer, config: Any, needs: str,
                       untrainable: str | None = None) -> dict | None:
    """``TrainableRole.update`` of a component training ``module``: ``optimizer_step`` on ``config["loss"]`` (from
    ``PPOModel.<needs>``) at ``state[model.lr_key]``; ``untrainable``: why it cannot train (raised after the check)."""
    who = type(model).__name__
    loss = config.get("loss") if isinstance(config, dict) else getattr(config, "loss", None)
    if loss is None:
        raise ValueError(f"{who}.update: config must hold 'loss', the scalar loss tensor of this batch "
                         f"(from PPOModel.{needs})")
    if untrainable:
        raise ValueError(f"{who}.update: {untrainable}")
    get = config.get if isinstance(config, dict) else (lambda k, d=None: d)
    return optimizer_step(module, optimizer, loss, model.state.get(model.lr_key), who, skip=bool(get("skip", False)),
                          boundary=get("boundary"))


def optimizer_step(module: Any, optimizer: torch.optim.Optimizer | None, loss: torch.Tensor, lr: float | None,
                   who: str, skip: bool = False, boundary: bool | None = None) -> dict | None:
    """backward + step (engine, or module + torch optimizer); {"grad_norm", "skipped", "zero_stage"} when a step was
    due, else None. ``skip`` drops it (under ZeRO via a NaN loss, which DeepSpeed's overflow check drops cleanly)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        raise ValueError(f"{who}.update: config['loss'] must be a scalar tensor that requires grad, got "
                         f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    engine_like = callable(getattr(module, "backward", None)) and callable(getattr(module, "step", None))
    opt = getattr(module, "optimizer", None) if engine_like else optimizer
    if lr is not None and opt is not None and getattr(module, "lr_scheduler", None) is None:
        for group in opt.param_groups:
            group["lr"] = lr
    if engine_like:
        explicit = boundary is not None
        if explicit:
            module.set_gradient_accumulation_boundary(bool(boundary))
        boundary = module.is_gradient_accumulation_boundary()
        zero = module.zero_optimization_stage() > 0
        module.backward(loss * float("nan") if skip and zero else loss, scale_wrt_gas=not explicit)
        if skip and not zero:
            for p in module.module.parameters():
                p.grad = None
        skipped_before = module.skipped_steps
        module.step()
        if not boundary:
            return None
        return {"grad_norm": module.get_global_grad_norm(),
                "skipped": module.skipped_steps > skipped_before or (skip and not zero),
                "zero_stage": module.zero_optimization_stage()}
    if optimizer is None:
        raise ValueError(f"{who}.update got a loss but has no optimizer: pass optimizer= at construction or "
                         f"wrap the model in a DeepSpeed engine")
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])) if params else None
    if not skip:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm, "skipped": skip, "zero_stage": 0}
