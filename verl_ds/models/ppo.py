"""PPOModel: the RL algorithm over actor, reward, an optional critic and an optional frozen reference, as calls the
trainer schedules (``compute_advantage``, ``compute_policy_loss``, ``compute_value_loss``, ``update``: the KL
controller). Hot hyper-parameters come from the SharedState at every call; metrics are verl's names, 0-d tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from verl_ds import algos
from verl_ds.algos.distill import DISTILL_MODES
from verl_ds.algos.mismatch import check_mode, mismatch_weights, parse_rejection
from verl_ds.batch import RolloutBatch
from verl_ds.config.limits import FULL_KL_KIND
from verl_ds.models.base import MissingModuleError, TrainableRole
from verl_ds.models.full_kl import logprobs_with_full_kl
from verl_ds.models.policy import PolicyModel, ReferenceModel
from verl_ds.models.reward import RewardModel
from verl_ds.models.value import ValueModel
from verl_ds.registry import ModelRegistry
from verl_ds.state import STATE_KEYS, SharedState

__all__ = ["PPOModel"]

_ROLES = ("actor", "critic", "reward", "ref")
_KINDS = {"actor": PolicyModel, "critic": ValueModel, "reward": RewardModel, "ref": ReferenceModel}


def _need(batch: Any, fields: tuple[str, ...], who: str) -> None:
    for f in fields:
        if batch[f] is None:
            raise ValueError(f"{who}: batch.{f} is missing (None)")


# metrics whose micro-batch value is that micro-batch's share of its mini-batch's loss (every agg_loss divides by
# the mini-batch's global count): the trainer adds them up per mini-batch, so they do not depend on the split
LOSS_SHARE_METRICS = ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss")


def _role(role: str, optional: bool = False) -> property:
    """The current component of ``role`` (``PPOModel._get``); setting it swaps it in."""
    return property(lambda self: self._get(role, optional), lambda self, m: self.swap(role, m))


class PPOModel(TrainableRole):
    """The algorithm over components looked up in a ModelRegistry at every call, so ``swap("reward", new)`` takes
    effect at the next one. A critic is required exactly when the estimator needs one. Rollout-mismatch correction
    (``algos.mismatch``): ``is_cap`` None turns the importance weights off, else they follow ``is_mode`` with the
    band [``is_low``, ``is_cap``]; ``is_rejection`` (a criteria string) leaves out tokens with or without them."""

    required_modules = ("actor", "reward")
    module_types = _KINDS

    def __init__(self, actor: PolicyModel, reward: RewardModel, critic: ValueModel | None = None,
                 ref: ReferenceModel | None = None, state: SharedState | None = None, algo: Any = None,
                 registry: ModelRegistry | None = None, names: dict[str, str] | None = None,
                 is_cap: float | None = None, is_mode: str = "truncate", is_low: float = 0.0,
                 is_rejection: str | None = None):
        if is_cap is not None and (isinstance(is_cap, bool) or not isinstance(is_cap, (int, float)) or not is_cap >= 1):
            raise ValueError(f"PPOModel: is_cap must be None (no importance sampling correction) or a number >= 1, "
                             f"got {is_cap!r}")
        try:
            check_mode(is_mode, 2.0 if is_cap is None else is_cap, is_low)
            self.is_rejection = parse_rejection(is_rejection)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"PPOModel: is_{exc}") from None
        self.is_cap = None if is_cap is None else float(is_cap)
        self.is_mode, self.is_low = is_mode, float(is_low)
        if state is None and isinstance(actor, PolicyModel):  # anything else is refused by name below
            state = actor.state
        super().__init__(state=state, actor=actor, critic=critic, reward=reward, ref=ref)
        if algo is None:
            from verl_ds.config import AlgoConfig

            algo = AlgoConfig()
        self.algo = algo
        self._estimator = algos.get_advantage_estimator(algo.adv_estimator)
        self._kl_placement = algos.resolve_kl_placement(algo.kl_placement, algo.adv_estimator)  # "reward" or "loss"
        self._policy_loss = algos.get_policy_loss(algo.policy_loss)
        self._loss_agg_mode = algos.resolve_policy_loss_agg_mode(algo.policy_loss, algo.loss_agg_mode,
                                                                 algo.adv_estimator)
        if self._estimator.needs_critic and critic is None:
            raise MissingModuleError(f"Missing required module: critic (algo.adv_estimator={algo.adv_estimator!r} "
                                     f"estimates advantages with a critic; the critic-free estimators are "
                                     f"{[n for n in algos.ADV_ESTIMATOR_NAMES if not algos.get_advantage_estimator(n).needs_critic]})")
        self._registry = registry if registry is not None else ModelRegistry()
        self._names = {role: role for role in _ROLES}
        for role, name in (names or {}).items():
            if role not in _ROLES:
                raise ValueError(f"PPOModel: names has unknown role {role!r}; roles: {list(_ROLES)}")
            self._names[role] = name
        for role, model in zip(_ROLES, (actor, critic, reward, ref)):
            if model is not None:
                self.swap(role, model)
        self.kl_controller = self._make_controller(self._state.snapshot())

    @property
    def needs_critic(self) -> bool:
        return self._estimator.needs_critic

    @property
    def loss_agg_mode(self) -> str:
        """``algo.loss_agg_mode`` with ``auto`` resolved for the policy loss and the estimator."""
        return self._loss_agg_mode

    @property
    def needs_baseline(self) -> bool:
        """ReMax: the estimator needs one greedy response's score per prompt."""
        return self._estimator.needs_baseline

    # ---- components -----------------------------------------------------------------------------
    def swap(self, role: str, model: Any) -> int:
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
        name = self._names[role]
        model = self._registry.get(name, None) if optional else self._registry.get(name)
        if model is not None and not isinstance(model, _KINDS[role]):
            raise TypeError(f"PPOModel: registry entry {name!r} ({role}) must be a {_KINDS[role].__name__}, got "
                            f"{type(model).__name__}")
        return model

    # Reads go through the registry at every access; ``ppo.reward = new`` is ``ppo.swap("reward", new)``.
    actor, reward = _role("actor"), _role("reward")
    critic, ref = _role("critic", optional=True), _role("ref", optional=True)  # None when not built

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

    # ---- advantages -------------------------------------------------------------------------------
    def kl_in_reward(self, hot: dict | None = None) -> bool:
        return self._kl_placement == "reward" and _kl_active(self._state.snapshot() if hot is None else hot)

    def kl_in_loss(self, hot: dict | None = None) -> bool:
        return self._kl_placement == "loss" and _kl_active(self._state.snapshot() if hot is None else hot)

    def compute_advantage(self, batch: Any,
                          whiten_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                          baseline_scores: torch.Tensor | None = None,
                          distill: tuple[str, torch.Tensor] | None = None) -> dict:
        """Fill ``batch.token_rewards`` (scores - kl_coef * KL when the KL is in the reward), ``advantages`` and
        ``returns``; returns metrics. ``whiten_fn(adv, response_mask)`` (the trainer passes a DP-global one)
        whitens GAE advantages when ``algo.whiten_advantages``; ``baseline_scores`` (B,): ReMax's. ``distill``:
        (mode, (B, R) term) of on-policy distillation (``algos.distill``), added to the token rewards before the
        estimator (mode "reward") or to its advantages (mode "advantage")."""
        who = "PPOModel.compute_advantage"
        given, batch = batch, RolloutBatch.coerce(batch, who)
        hot = self._state.snapshot()
        _need(batch, ("observation", "mask", "response_mask", "scores"), who)
        if distill is not None and distill[0] not in DISTILL_MODES:
            raise ValueError(f"{who}: distill mode must be one of {list(DISTILL_MODES)}, got {distill[0]!r}")
        est = self._estimator
        if est.needs_critic:
            _need(batch, ("values",), who)
        if est.needs_groups:
            _need(batch, ("group_index",), who)
        if est.needs_baseline and baseline_scores is None:
            raise ValueError(f"{who}: algo.adv_estimator={self.algo.adv_estimator!r} needs baseline_scores (B,) "
                             f"(ReMax: the greedy response's score)")
        mask = batch.response_mask
        fmask = mask.float()
        metrics = {}
        with torch.no_grad():
            scores = batch.scores.float()
            if self.kl_in_reward(hot):
                _need(batch, ("old_log_probs", "ref_log_probs"), who)
                kl = algos.kl_penalty(batch.old_log_probs, batch.ref_log_probs, hot["kl_kind"]) * fmask
                rewards = scores - hot["kl_coef"] * kl
                metrics["actor/reward_kl_penalty"] = (kl.sum(-1) / fmask.sum(-1).clamp(min=1)).mean()
                metrics["actor/reward_kl_penalty_coeff"] = torch.tensor(hot["kl_coef"], dtype=torch.float64)
            else:
                rewards = scores
            if distill is not None and distill[0] == "reward":
                rewards = rewards + distill[1]
            values = batch.values.float() * fmask if est.needs_critic else None
            adv, ret = est(rewards, mask, values=values, group_index=batch.group_index,
                           baseline_scores=baseline_scores, gamma=hot["gamma"], lam=hot["lam"], whiten_fn=whiten_fn)
            if est.needs_critic and self.algo.whiten_advantages:
                adv = (whiten_fn or algos.masked_whiten)(adv, mask)
            if distill is not None and distill[0] == "advantage":
                adv = adv + distill[1]
            adv, ret = adv * fmask, ret * fmask
        batch.token_rewards, batch.advantages, batch.returns = rewards, adv, ret
        if given is not batch:  # a plain mapping: the results go back into it too
            given.update(token_rewards=rewards, advantages=adv, returns=ret)
        summaries = [("score", scores, True), ("rewards", rewards, True), ("advantages", adv, False),
                     ("returns", ret, False)]
        if values is not None:
            summaries.append(("values", values, False))
        for name, mat, per_seq in summaries:  # rollout/ whatever the algorithm; critic/ only with a critic
            x = mat.sum(-1) if per_seq else mat[mask]
            ns = "critic" if name == "values" else "rollout"
            metrics.update({f"{ns}/{name}/mean": x.mean(), f"{ns}/{name}/max": x.max(), f"{ns}/{name}/min": x.min()})
        return metrics

    # ---- losses ------------------------------------------------------------------------------------
    def compute_policy_loss(self, batch: Any, normalizer: float | torch.Tensor | None = None):
        """(loss, metrics): ``algo.policy_loss`` - entropy_coef * agg(entropy) [+ kl_coef * agg(KL) when
        the KL is in the loss]. Without batch.old_log_probs (an on-policy update whose forward is the scoring
        pass's) the actor's own detached log-probs stand in (ratio 1). ``normalizer`` goes to every agg_loss."""
        who = "PPOModel.compute_policy_loss"
        batch = RolloutBatch.coerce(batch, who)
        hot = self._state.snapshot()
        _need(batch, ("observation", "action", "mask", "response_mask", "advantages"), who)
        if self.is_cap is not None or self.is_rejection:
            _need(batch, ("rollout_log_probs",), who)
        kl_in_loss = self.kl_in_loss(hot)
        if kl_in_loss:
            _need(batch, ("ref_log_probs",), who)
        mask = batch.response_mask
        mode, max_len = self._loss_agg_mode, hot["max_new_tokens"]
        kl = None
        if kl_in_loss and hot["kl_kind"] == FULL_KL_KIND:  # exact over the vocabulary, from the LM heads
            log_probs, entropy, kl = logprobs_with_full_kl(self.actor, self.ref, batch.observation, batch.action,
                                                           batch.mask, hot["temperature"])
        else:
            log_probs, entropy = self.actor.get_logprob(batch.observation, batch.action, mask=batch.mask,
                                                        temperature=hot["temperature"], return_entropy=True)
        old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
        is_weights, is_metrics = None, {}
        if self.is_cap is not None or self.is_rejection:  # the sampler is not the trainer (vLLM, bf16, stale weights)
            is_weights, is_metrics = mismatch_weights(old, batch.rollout_log_probs, mask,
                                                      None if self.is_cap is None else self.is_mode, self.is_cap,
                                                      self.is_low, self.is_rejection)
        elif batch.old_log_probs is not None and batch.rollout_log_probs is not None:  # the gap, with no correction
            gap = mismatch_weights(old, batch.rollout_log_probs, mask, None)[1]
            is_metrics = {k: v for k, v in gap.items() if k.startswith(("mismatch_", "is_ratio_"))}
        params = algos.PolicyLossParams(hot["clip_ratio_low"], hot["clip_ratio_high"], self.algo.clip_ratio_c,
                                        self.algo.sapo_tau_pos, self.algo.sapo_tau_neg)
        pg_loss, pg_metrics = self._policy_loss(log_probs, old, batch.advantages, mask, params, mode, normalizer,
                                                is_weights, max_len)
        pg_metrics.update(is_metrics)
        coef = hot["entropy_coef"]
        loss = pg_loss
        if coef:
            loss = loss - coef * algos.agg_loss(entropy, mask, mode, normalizer=normalizer, max_len=max_len)
        metrics = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": algos.masked_mean(entropy.detach(), mask)}
        metrics.update({f"actor/{k}": v for k, v in pg_metrics.items()})
        if kl_in_loss:
            if kl is None:
                kl = algos.kl_penalty(log_probs, batch.ref_log_probs, hot["kl_kind"])
            kl_loss = algos.agg_loss(kl, mask, mode, normalizer=normalizer, max_len=max_len)
            loss = loss + hot["kl_coef"] * kl_loss
            metrics.update({"actor/kl_loss": kl_loss.detach(), "actor/kl_coef": torch.tensor(hot["kl_coef"], dtype=torch.float64)})
        return loss, metrics

    def compute_value_loss(self, batch: Any, normalizer: float | torch.Tensor | None = None):
        """(loss, metrics): clipped value loss of a fresh critic pass (WITH grad) against batch.returns, clipped
        around batch.values (the rollout's) by the state's cliprange_value (0 disables clipping)."""
        who = "PPOModel.compute_value_loss"
        batch = RolloutBatch.coerce(batch, who)
        hot = self._state.snapshot()
        _need(batch, ("observation", "mask", "response_mask", "values", "returns"), who)
        if self.critic is None:
            raise MissingModuleError("Missing required module: critic (compute_value_loss needs a ValueModel)")
        mask = batch.response_mask
        values = self.critic.get_values(batch.observation, batch.mask, mask.shape[1])
        returns = batch.returns
        vf_loss, vf_metrics = algos.value_loss(values, batch.values, returns, mask, hot["cliprange_value"],
                                               self._loss_agg_mode, normalizer=normalizer,
                                               max_len=hot["max_new_tokens"])
        with torch.no_grad():  # verl's explained variance: 1 - Var(R - V) / (Var(R) + 1e-8), over valid tokens
            v, r = values.detach()[mask], returns[mask]
            explained = (1.0 - (r - v).var(unbiased=False) / (r.var(unbiased=False) + 1e-8)) if r.numel() \
                else torch.zeros(())
        metrics = {"critic/vf_loss": vf_loss.detach(), "critic/vpred_mean": algos.masked_mean(values.detach(), mask),
                   "critic/vf_explained_var": explained}
        metrics.update({f"critic/{k}": v for k, v in vf_metrics.items()})
        return vf_loss, metrics

    # ---- the KL controller ------------------------------------------------------------------------------
    def _make_controller(self, hot: dict):
        return algos.make_kl_controller(hot["kl_ctrl_type"], init_kl_coef=hot["kl_coef"], target_kl=hot["target_kl"],
                                        horizon=self.algo.kl_horizon)

    def update(self, batch: Any, config: Any = None):
        """Step the KL controller with the global ``config["observed_kl"]`` and ``config["n_samples"]``; rank 0 writes
        kl_coef to the SharedState. A controller changed from outside (kind, target, coefficient) is rebuilt."""
        config = config or {}
        if "observed_kl" not in config:
            raise ValueError("PPOModel.update: config must hold 'observed_kl' (the global token-mean KL) and "
                             "'n_samples'")
        hot = self._state.snapshot()
        ctrl = self.kl_controller
        if ctrl.name != _canonical(hot["kl_ctrl_type"]) or getattr(ctrl, "target_kl", hot["target_kl"]) != hot["target_kl"] \
                or abs(float(ctrl.value) - hot["kl_coef"]) > 1e-12:
            ctrl = self.kl_controller = self._make_controller(hot)
        ctrl.update(float(config["observed_kl"]), int(config.get("n_samples", len(batch) if batch is not None else 1)))
        lo, hi = STATE_KEYS["kl_coef"].range
        if self._state.rank == 0:
            self._state.set("kl_coef", min(max(float(ctrl.value), lo), hi))

    # ---- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"kl_controller": the controller's state}; the algo knobs come from the config."""
        return {"kl_controller": self.kl_controller.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore the KL controller of the checkpointed kind (the hot value wins over the config's)."""
        unknown = set(sd) - {"kl_controller"}
        if unknown:
            raise KeyError(f"PPOModel.load_state_dict: unknown keys {sorted(unknown)}; known: ['kl_controller']")
        saved = sd["kl_controller"]
        hot = self._state.snapshot()
        hot.update(kl_ctrl_type=saved["kind"], kl_coef=saved["value"], target_kl=saved.get("target_kl", hot["target_kl"]))
        ctrl = self._make_controller(hot)
        ctrl.load_state_dict(saved)
        self.kl_controller = ctrl


def _canonical(kind: str) -> str:
    from verl_ds.algos.kl_ctrl import KL_CONTROLLERS

    return KL_CONTROLLERS.canonical(kind)


def _kl_active(hot: dict) -> bool:
    """A KL term is active when it is on and its coefficient is positive or a controller may make it so."""
    return hot["use_kl_penalty"] and (hot["kl_coef"] > 0 or _canonical(hot["kl_ctrl_type"]) != "fixed")
