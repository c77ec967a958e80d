"""PPOModel: actor, critic, reward (and an optional frozen reference) behind separate PPO calls that the
trainer schedules: ``compute_advantage``, ``compute_policy_loss``, ``compute_value_loss``, ``update``.

Hot hyper-parameters (kl_coef, kl_kind, use_kl_penalty, clip_ratio_low/high, cliprange_value,
entropy_coef, gamma, lam, temperature, kl_ctrl_type, target_kl) are read from the SharedState at
every call; the static knobs are in :class:`PPOConfig`. The numerics are ``verl_ds.algos``.

Metric names follow verl (peers.md "Metrics verl logs"); every metric value is a python float.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from verl_ds import algos
from verl_ds.models.base import BaseModel
from verl_ds.models.policy import PolicyModel
from verl_ds.models.reward import RewardModel
from verl_ds.models.value import ValueModel
from verl_ds.registry import ModelRegistry
from verl_ds.state import STATE_KEYS, SharedState

__all__ = ["PPOModel", "PPOConfig"]

_ROLES = ("actor", "critic", "reward", "ref")
_KINDS = {"actor": PolicyModel, "critic": ValueModel, "reward": RewardModel, "ref": PolicyModel}


@dataclass
class PPOConfig:
    """Static PPO knobs (fixed for a run; the hot ones live in SharedState).

    loss_agg_mode: how loss matrices are reduced (verl's agg_loss modes).
    clip_ratio_c: dual-clip constant for negative advantages (> 1); None disables dual clip.
    kl_in_reward: True puts -kl_coef * KL into the token rewards (verl use_kl_in_reward); False adds
        kl_coef * agg(KL) to the policy loss (verl use_kl_loss). Either only when use_kl_penalty.
    whiten_advantages: whiten advantages over the valid response tokens after GAE.
    kl_horizon: horizon H of the adaptive (Ziegler) controller, in samples.
    """

    loss_agg_mode: str = "token-mean"
    clip_ratio_c: float | None = 3.0
    kl_in_reward: bool = True
    whiten_advantages: bool = True
    kl_horizon: int = 10000

    def __post_init__(self):
        if self.clip_ratio_c is not None and not (isinstance(self.clip_ratio_c, (int, float)) and self.clip_ratio_c > 1):
            raise ValueError(f"PPOConfig.clip_ratio_c must be > 1 (dual clip) or None, got {self.clip_ratio_c!r}")
        for key in ("kl_in_reward", "whiten_advantages"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"PPOConfig.{key} must be a bool, got {getattr(self, key)!r}")
        if isinstance(self.kl_horizon, bool) or not isinstance(self.kl_horizon, int) or self.kl_horizon < 1:
            raise ValueError(f"PPOConfig.kl_horizon must be an int >= 1, got {self.kl_horizon!r}")
        if not isinstance(self.loss_agg_mode, str):
            raise TypeError(f"PPOConfig.loss_agg_mode must be a str, got {self.loss_agg_mode!r}")


def _as_config(config: Any, default: PPOConfig) -> PPOConfig:
    if config is None:
        return default
    if isinstance(config, PPOConfig):
        return config
    if isinstance(config, dict):
        names = {f.name for f in dataclasses.fields(PPOConfig)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"PPOConfig: unknown keys {unknown}; valid: {sorted(names)} (hot values such as kl_coef "
                             f"live in SharedState)")
        return PPOConfig(**config)
    raise TypeError(f"config must be a PPOConfig, a dict or None, got {type(config).__name__}")


def _need(batch: Any, fields: tuple[str, ...], who: str) -> None:
    for f in fields:
        if batch[f] is None:
            raise ValueError(f"{who}: batch.{f} is missing (None)")


def _f(x: torch.Tensor | float) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


class PPOModel(BaseModel):
    """PPO over actor/critic/reward/ref components (see module docstring).

    The components are kept in a ModelRegistry (``registry``: default a private one; pass the
    trainer's or ``default_registry()`` to expose them) under ``names`` (role -> name, default the
    role), and looked up at every call: ``swap("reward", new_reward)`` (or registering a new model
    under that name) takes effect at the next call. All components share this model's SharedState
    (PPOModel points theirs at it). The KL controller is ``kl_controller``; its state is in
    ``state_dict()``.
    """

    required_modules = ("actor", "critic", "reward")
    module_types = _KINDS

    def __init__(self, actor: PolicyModel, critic: ValueModel, reward: RewardModel, ref: PolicyModel | None = None,
                 state: SharedState | None = None, config: PPOConfig | dict | None = None,
                 registry: ModelRegistry | None = None, names: dict[str, str] | None = None):
        if state is None and isinstance(actor, BaseModel):
            state = actor.state
        super().__init__(state=state, actor=actor, critic=critic, reward=reward, ref=ref)
        self.config = _as_config(config, PPOConfig())
        self._registry = registry if registry is not None else ModelRegistry()
        self._names = {role: role for role in _ROLES}
        for role, name in (names or {}).items():
            if role not in _ROLES:
                raise ValueError(f"PPOModel: names has unknown role {role!r}; roles: {list(_ROLES)}")
            self._names[role] = name
        for role, model in zip(_ROLES, (actor, critic, reward, ref)):
            if model is not None:
                self.swap(role, model)
        hot = self._state.snapshot()
        self.kl_controller = self._make_controller(hot)

    # ---- components -----------------------------------------------------------------------------
    def swap(self, role: str, model: BaseModel) -> int:
        """Register ``model`` for ``role`` (actor/critic/reward/ref); returns the registry version."""
        if role not in _ROLES:
            raise ValueError(f"PPOModel.swap: unknown role {role!r}; roles: {list(_ROLES)}")
        if not isinstance(model, _KINDS[role]):
            raise TypeError(f"PPOModel: module {role!r} must be a {_KINDS[role].__name__}, got {type(model).__name__}")
        model._state = self._state
        name = self._names[role]
        if self._registry.get(name, None) is model:  # already there (a shared registry): no version bump
            return self._registry.version(name)
        return self._registry.register(name, model)

    def _get(self, role: str, optional: bool = False):
        model = self._registry.get(self._names[role], None) if optional else self._registry.get(self._names[role])
        if model is not None and not isinstance(model, _KINDS[role]):
            raise TypeError(f"PPOModel: registry entry {self._names[role]!r} ({role}) must be a "
                            f"{_KINDS[role].__name__}, got {type(model).__name__}")
        return model

    # Reads go through the registry at every access; ``ppo.reward = new`` is ``ppo.swap("reward", new)``.
    actor = property(lambda self: self._get("actor"), lambda self, m: self.swap("actor", m),
                     doc="The current actor (PolicyModel).")
    critic = property(lambda self: self._get("critic"), lambda self, m: self.swap("critic", m),
                      doc="The current critic (ValueModel).")
    reward = property(lambda self: self._get("reward"), lambda self, m: self.swap("reward", m),
                      doc="The current RewardModel.")
    ref = property(lambda self: self._get("ref", optional=True), lambda self, m: self.swap("ref", m),
                   doc="The reference PolicyModel or None.")

    @property
    def registry(self) -> ModelRegistry:
        return self._registry

    def torch_modules(self) -> list:
        out = []
        for role in _ROLES:
            m = self._get(role, optional=True)
            if m is not None:
                out.extend(m.torch_modules())
        return out

    # ---- KL controller --------------------------------------------------------------------------
    def _make_controller(self, hot: dict):
        return algos.make_kl_controller(hot["kl_ctrl_type"], init_kl_coef=hot["kl_coef"], target_kl=hot["target_kl"],
                                        horizon=self.config.kl_horizon)

    def _controller_for(self, hot: dict):
        """The controller matching the current SharedState: rebuilt (from the state's kl_coef) when
        kl_ctrl_type or target_kl changed, or when kl_coef was changed from outside."""
        ctrl = self.kl_controller
        built = (self._ctrl_kind, self._ctrl_target)
        if built != (hot["kl_ctrl_type"], hot["target_kl"]) or abs(float(ctrl.value) - hot["kl_coef"]) > 1e-12:
            self.kl_controller = ctrl = self._make_controller(hot)
        return ctrl

    @property
    def kl_controller(self):
        return self._kl_controller

    @kl_controller.setter
    def kl_controller(self, ctrl) -> None:
        self._kl_controller = ctrl
        hot = self._state.snapshot()
        self._ctrl_kind, self._ctrl_target = hot["kl_ctrl_type"], hot["target_kl"]

    # ---- PPO calls ------------------------------------------------------------------------------
    def compute_advantage(self, batch: Any, config: PPOConfig | dict | None = None,
                          whiten_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict:
        """Fill batch.value/old_value (a fresh critic pass, no_grad), batch.reward, batch.advantage and
        batch.return; returns metrics.

        Task scores come from ``batch.score`` (B, R); when it is None, ``batch.reward`` is taken as the
        scores and moved to ``batch.score`` (so calling this twice never subtracts the KL twice).
        Token rewards = score - kl_coef * kl_penalty(logprob, ref_logprob, kl_kind) when
        config.kl_in_reward and use_kl_penalty, else score. GAE with gamma/lam; with
        whiten_advantages, ``whiten_fn(adv, response_mask)`` (default algos.masked_whiten; the trainer
        passes a DP-global one). Advantages and returns are zero on padding.
        """
        who = "PPOModel.compute_advantage"
        cfg = _as_config(config, self.config)
        hot = self._state.snapshot()
        if batch.score is None:
            if batch.reward is None:
                raise ValueError(f"{who}: batch.score is missing: set it to the token scores from "
                                 f"RewardModel.compute_rewards")
            batch.score = batch.reward
        _need(batch, ("observation", "mask", "response_mask", "score"), who)
        kl_in_reward = cfg.kl_in_reward and hot["use_kl_penalty"]
        if kl_in_reward:
            _need(batch, ("logprob", "ref_logprob"), who)
        mask = batch.response_mask
        fmask = mask.float()
        R = mask.shape[1]
        with torch.no_grad():
            values = self.critic.get_values(batch.observation, batch.mask, R).float() * fmask  # (B, R)
            score = batch.score.float()
            metrics = {}
            if kl_in_reward:
                kl = algos.kl_penalty(batch.logprob, batch.ref_logprob, hot["kl_kind"]) * fmask
                rewards = score - hot["kl_coef"] * kl
                seq_kl = (kl.sum(-1) / fmask.sum(-1).clamp(min=1)).mean()
                metrics.update({"actor/reward_kl_penalty": _f(seq_kl), "actor/reward_kl_penalty_coeff": hot["kl_coef"]})
            else:
                rewards = score.clone()
            adv, ret = algos.compute_gae(rewards, values, mask, hot["gamma"], hot["lam"])
            if cfg.whiten_advantages:
                adv = (whiten_fn or algos.masked_whiten)(adv, mask)
            adv, ret = adv * fmask, ret * fmask
        batch.value, batch.old_value = values, values
        batch.reward, batch.advantage, batch["return"] = rewards, adv, ret
        for name, mat, per_seq in (("score", score, True), ("rewards", rewards, True), ("advantages", adv, False),
                                   ("returns", ret, False), ("values", values, False)):
            x = mat.sum(-1) if per_seq else mat[mask]
            metrics.update({f"critic/{name}/mean": _f(x.mean()), f"critic/{name}/max": _f(x.max()),
                            f"critic/{name}/min": _f(x.min())})
        return metrics

    def compute_policy_loss(self, batch: Any, config: PPOConfig | dict | None = None,
                            normalizer: float | torch.Tensor | None = None):
        """(loss, metrics): clipped surrogate (dual clip) - entropy_coef * agg(entropy)
        [+ kl_coef * agg(kl_penalty(logprob, ref_logprob, kl_kind)) when the KL is in the loss].

        The actor runs WITH grad (get_logprob at the state's temperature); batch.logprob is the old
        log-prob. ``normalizer`` goes to every agg_loss (global token count for DP/accumulation).
        """
        who = "PPOModel.compute_policy_loss"
        cfg = _as_config(config, self.config)
        hot = self._state.snapshot()
        _need(batch, ("observation", "action", "mask", "response_mask", "logprob", "advantage"), who)
        kl_in_loss = (not cfg.kl_in_reward) and hot["use_kl_penalty"]
        if kl_in_loss:
            _need(batch, ("ref_logprob",), who)
        mask = batch.response_mask
        logprob, entropy = self.actor.get_logprob(batch.observation, batch.action, mask=batch.mask,
                                                  temperature=hot["temperature"], return_entropy=True)
        pg_loss, pg_metrics = algos.policy_loss(logprob, batch.logprob, batch.advantage, mask, hot["clip_ratio_low"],
                                                hot["clip_ratio_high"], cfg.clip_ratio_c, cfg.loss_agg_mode,
                                                normalizer=normalizer)
        coef = hot["entropy_coef"]
        ent = algos.agg_loss(entropy if coef else entropy.detach(), mask, cfg.loss_agg_mode, normalizer=normalizer)
        loss = pg_loss - coef * ent if coef else pg_loss
        metrics = {"actor/pg_loss": _f(pg_loss), "actor/entropy": _f(algos.masked_mean(entropy.detach(), mask))}
        metrics.update({f"actor/{k}": _f(v) for k, v in pg_metrics.items()})
        if kl_in_loss:
            kl = algos.kl_penalty(logprob, batch.ref_logprob, hot["kl_kind"])
            kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode, normalizer=normalizer)
            loss = loss + hot["kl_coef"] * kl_loss
            metrics.update({"actor/kl_loss": _f(kl_loss), "actor/kl_coef": hot["kl_coef"]})
        return loss, metrics

    def compute_value_loss(self, batch: Any, config: PPOConfig | dict | None = None,
                           normalizer: float | torch.Tensor | None = None):
        """(loss, metrics): clipped value loss of a fresh critic pass (WITH grad) against batch.return,
        clipped around batch.old_value by the state's cliprange_value."""
        who = "PPOModel.compute_value_loss"
        cfg = _as_config(config, self.config)
        hot = self._state.snapshot()
        _need(batch, ("observation", "mask", "response_mask", "old_value", "return"), who)
        mask = batch.response_mask
        values = self.critic.get_values(batch.observation, batch.mask, mask.shape[1])
        returns = batch["return"]
        vf_loss, vf_metrics = algos.value_loss(values, batch.old_value, returns, mask, hot["cliprange_value"],
                                               cfg.loss_agg_mode, normalizer=normalizer)
        with torch.no_grad():  # verl's explained variance: 1 - Var(R - V) / (Var(R) + 1e-8), over valid tokens
            v, r = values.detach()[mask], returns[mask]
            explained = 1.0 - (r - v).var(unbiased=False) / (r.var(unbiased=False) + 1e-8) if r.numel() \
                else torch.tensor(0.0)
        metrics = {"critic/vf_loss": _f(vf_loss), "critic/vpred_mean": _f(algos.masked_mean(values.detach(), mask)),
                   "critic/vf_explained_var": _f(explained)}
        metrics.update({f"critic/{k}": _f(v) for k, v in vf_metrics.items()})
        return vf_loss, metrics

    def update(self, batch: Any, config: PPOConfig | dict | None = None, observed_kl: float | None = None,
               n_samples: int | None = None) -> None:
        """Step the KL controller with the observed KL and write the new kl_coef to SharedState.

        observed_kl defaults to the masked mean of kl_penalty(batch.logprob, batch.ref_logprob,
        kl_kind) over this batch's response tokens, n_samples to len(batch); with data parallelism
        pass the global values (the controller's speed depends on n, peers.md 2.5). The controller
        is rebuilt when kl_ctrl_type/target_kl (or kl_coef, from outside) changed in SharedState.
        kl_coef is written on rank 0 only (other ranks get it from sync()), clamped to its range.
        """
        hot = self._state.snapshot()
        ctrl = self._controller_for(hot)
        if observed_kl is None:
            if batch.ref_logprob is None or batch.logprob is None:
                if hot["kl_ctrl_type"] == "fixed":
                    return None
                raise ValueError("PPOModel.update: batch.logprob and batch.ref_logprob are needed to measure the KL "
                                 "(or pass observed_kl=)")
            kl = algos.kl_penalty(batch.logprob, batch.ref_logprob, hot["kl_kind"])
            observed_kl = _f(algos.masked_mean(kl, batch.response_mask))
        n = int(n_samples) if n_samples is not None else len(batch)
        ctrl.update(float(observed_kl), n)
        lo, hi = STATE_KEYS["kl_coef"].range
        value = min(max(float(ctrl.value), lo), hi)
        if self._state.rank == 0:
            self._state.set("kl_coef", value)
        return None

    # ---- the rest of the contract -----------------------------------------------------------------
    def get_action(self, observation, mask=None, temperature=1.0, top_k=50, top_p=0.95, generator=None):
        """The actor's get_action."""
        return self.actor.get_action(observation, mask, temperature, top_k, top_p, generator=generator)

    def get_value(self, observation, mask=None):
        """The critic's get_value."""
        return self.critic.get_value(observation, mask)

    def get_logprob(self, observation, action, mask=None, temperature=1.0, return_entropy=False):
        """The actor's get_logprob."""
        return self.actor.get_logprob(observation, action, mask, temperature, return_entropy)

    def get_reward(self, observation, mask=None):
        """The reward model's neural score."""
        return self.reward.get_reward(observation, mask)

    def state_dict(self) -> dict:
        """{"config": PPOConfig fields, "kl_controller": controller state, "kl_controller_type",
        "kl_controller_target"}."""
        return {"config": dataclasses.asdict(self.config), "kl_controller": self.kl_controller.state_dict(),
                "kl_controller_type": self._ctrl_kind, "kl_controller_target": self._ctrl_target}

    def load_state_dict(self, sd: dict) -> None:
        """Restore the config and the KL controller (of the saved type)."""
        unknown = set(sd) - {"config", "kl_controller", "kl_controller_type", "kl_controller_target"}
        if unknown:
            raise KeyError(f"PPOModel.load_state_dict: unknown keys {sorted(unknown)}")
        if "config" in sd:
            self.config = _as_config(dict(sd["config"]), self.config)
        if "kl_controller" in sd:
            hot = self._state.snapshot()
            hot["kl_ctrl_type"] = sd.get("kl_controller_type", hot["kl_ctrl_type"])
            hot["target_kl"] = sd.get("kl_controller_target", hot["target_kl"])
            ctrl = self._make_controller(hot)
            ctrl.load_state_dict(sd["kl_controller"])
            self._kl_controller = ctrl
            self._ctrl_kind, self._ctrl_target = hot["kl_ctrl_type"], hot["target_kl"]
