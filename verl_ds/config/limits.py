"""Limits on hot hyper-parameters that depend on the run, shared by the config checks and SharedState's hot updates:
the KL estimator a KL placement can use, and the response length (computed in ``verl_ds.resolved_config``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

# KL estimators whose gradient has zero expectation under the policy's own samples:
# grad E_{y~pi}[log pi(y) - log pi_ref(y)] with y held fixed = E_{y~pi}[grad log pi(y)] = 0 (the score function
# identity), so as a loss term they regularise nothing (Schulman, "Approximating KL Divergence", 2020).
ZERO_GRADIENT_KL = ("k1", "kl")
# the exact full-vocabulary KL (verl_ds.models.full_kl): needs the actor's LM head, so the loss only
FULL_KL_KIND = "full_symmetric"
LOSS_KL_DEFAULT = "low_var_kl"
REWARD_KL_DEFAULT = "k1"


def kl_placement_rule(kl_placement: str, kl_kind: str) -> Optional[str]:
    """Why ``kl_kind`` cannot be used at ``kl_placement``, or None when it can."""
    if kl_placement == "loss" and kl_kind in ZERO_GRADIENT_KL:
        return (f"{kl_kind!r} in the loss (algo.kl_placement=loss) regularises nothing: the gradient of "
                f"k1 = log(pi/pi_ref) has zero expectation under the policy's own samples; use low_var_kl (k3, "
                f"the default for the loss) or k2 (mse), or put the KL in the reward")
    if kl_placement == "reward" and kl_kind == FULL_KL_KIND:
        return (f"{kl_kind!r} is computed over the whole vocabulary from the actor's LM head during its update, so "
                f"it can only be a loss term: set algo.kl_placement=loss, or use 'symmetric' (its sampled-token "
                f"estimate) in the reward")
    return None


def resolve_kl_kind(kl_kind: str, kl_placement: str) -> str:
    """``auto`` -> k1 in the reward, low_var_kl in the loss; any other name is returned as it is."""
    if kl_kind != "auto":
        return kl_kind
    return LOSS_KL_DEFAULT if kl_placement == "loss" else REWARD_KL_DEFAULT


@dataclass(frozen=True)
class Bound:
    """An inclusive upper limit on a hot key for this run, and why."""
    max: float
    why: str


def has_reference(cfg) -> bool:
    """Whether a run builds a frozen reference: only then can a KL term be non-zero (``algo.kl_coef > 0`` or an
    adaptive KL controller at start-up; ``algo.kl_ctrl`` holds the controllers' own names, no aliases)."""
    return cfg.algo.kl_coef > 0 or cfg.algo.kl_ctrl != "fixed"


# hot key -> (whether a value turns a KL term on, the value that keeps it off)
_KL_SWITCHES = {"kl_coef": (lambda v: v > 0, 0.0), "use_kl_penalty": (lambda v: v is True, False),
                "kl_ctrl_type": (lambda v: v != "fixed", "fixed")}
_NO_REFERENCE = ("this run has no reference model (it started with algo.kl_coef=0 and algo.kl_ctrl=fixed), so no KL "
                 "term can be turned on")


@dataclass(frozen=True)
class RunLimits:
    """Limits of one run that hot updates must respect (``SharedState(rank, limits=verl_ds.resolved_config.run_limits(cfg))``).
    ``reference``: whether the run built a frozen reference (without one, KL keys cannot turn a KL term on)."""
    upper: Mapping[str, Bound] = field(default_factory=dict)
    kl_placement: str = "reward"
    reference: bool = True

    def check(self, values: Mapping, changed: Iterable[str]) -> dict[str, str]:
        """key -> reason for each of the ``changed`` keys whose new value (in ``values``) breaks a limit."""
        errors = {}
        for key in changed:
            if not self.reference and key in _KL_SWITCHES and _KL_SWITCHES[key][0](values[key]):
                errors[key] = (f"{values[key]!r} refused: {_NO_REFERENCE}; {key} must stay {_KL_SWITCHES[key][1]!r} "
                               "(restart with algo.kl_coef > 0 or an adaptive algo.kl_ctrl for a KL term)")
            bound = self.upper.get(key)
            if bound is not None and values[key] > bound.max:
                errors[key] = f"{values[key]!r} exceeds this run's limit {bound.max} ({bound.why})"
            if key == "kl_kind":
                why = kl_placement_rule(self.kl_placement, values[key])
                if why is not None:
                    errors[key] = why
        return errors


def sequence_tokens(cfg) -> int:
    """The most tokens one sample can hold: a multi-turn trajectory's ``agent.max_context_tokens``, else the
    longest prompt and response."""
    if cfg.agent.environment is not None:
        return cfg.agent.max_context_tokens
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
