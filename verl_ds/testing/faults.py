"""Fault injection for tests: ``VERL_DS_FAULT`` breaks a real run at chosen points. The trainer knows nothing of
faults: an injector subscribes to its events and hooks the actor's module for NaN logits. The spec's table:
docs/reliability.md, "Fault injection for tests"."""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

FAULT_ENV = "VERL_DS_FAULT"
SAVE_POINTS = ("after_actor", "after_critic", "before_manifest", "before_latest")  # checkpoint.save's events
FAULT_POINTS = ("step_begin",) + SAVE_POINTS
# where nan_logits poisons the actor's logits: log-prob pass, update forward, or generation (the draw fails)
PHASES = ("rollout", "update", "sampling")


@dataclass
class Fault:
    """One injected fault: ``action`` at ``point`` on ``steps`` (None: any) of ``rank`` (None: every rank)."""
    action: str  # kill | hang | signal | nan_logits
    point: str
    steps: Optional[frozenset] = None
    rank: Optional[int] = None
    options: dict = field(default_factory=dict)


_ACTIONS = {"kill_at": "kill", "hang_at": "hang", "signal_at": "signal", "nan_logits_at_step": "nan_logits"}
_OPTIONS = {"kill": {"step", "rank"}, "hang": {"step", "rank"}, "signal": {"step", "rank", "sig"},
            "nan_logits": {"rank", "sample", "pos", "phase"}}


def _steps(text: str, where: str) -> frozenset:
    out = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{FAULT_ENV}: {where}: expected steps like 3, 3,5 or 4-6, got {text!r}") from None
    return frozenset(out)


def parse_faults(spec: str) -> list[Fault]:
    """Parse ``VERL_DS_FAULT``: faults separated by ``;``, each ``action=value`` then ``:key=value`` options."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        head, *opts = item.split(":")
        name, eq, value = head.partition("=")
        if name not in _ACTIONS or not eq or not value:
            raise ValueError(f"{FAULT_ENV}: {item!r}: expected one of {', '.join(k + '=...' for k in _ACTIONS)}")
        action = _ACTIONS[name]
        options = {}
        for opt in opts:
            k, eq, v = opt.partition("=")
            if not eq or k not in _OPTIONS[action]:
                raise ValueError(f"{FAULT_ENV}: {item!r}: unknown option {opt!r}; {name} takes "
                                 f"{', '.join(sorted(_OPTIONS[action]))}")
            options[k] = v
        fault = Fault(action=action, point="step_begin" if action == "nan_logits" else value)
        if action == "nan_logits":
            fault.steps = _steps(value, item)
            fault.rank = int(options.pop("rank", 0))
            phase = options.setdefault("phase", "rollout")
            if phase not in PHASES:
                raise ValueError(f"{FAULT_ENV}: {item!r}: phase must be {', '.join(PHASES)}, got {phase!r}")
            options["sample"], options["pos"] = int(options.get("sample", 0)), int(options.get("pos", 0))
        else:
            if value not in FAULT_POINTS:
                raise ValueError(f"{FAULT_ENV}: {item!r}: unknown point {value!r}; points: {', '.join(FAULT_POINTS)}")
            fault.steps = _steps(options.pop("step"), item) if "step" in options else None
            fault.rank = int(options.pop("rank")) if "rank" in options else None
            if action == "signal":
                sig = options.setdefault("sig", "TERM").upper().removeprefix("SIG")
                if sig not in ("TERM", "USR1", "INT", "KILL"):
                    raise ValueError(f"{FAULT_ENV}: {item!r}: sig must be TERM, USR1, INT or KILL, got {sig!r}")
                options["sig"] = sig
        fault.options = options
        faults.append(fault)
    return faults


class FaultInjector:
    """Carries out parsed faults in a real run: ``on_event`` from the trainer's events, ``attach`` for NaN logits."""

    def __init__(self, faults: list[Fault], rank: int = 0):
        self.faults, self.rank = list(faults), rank
        self.step = 0
        self._fired: set = set()
        self._hook = self._sampling_hook = None

    @classmethod
    def from_env(cls, rank: int = 0, env=None) -> Optional["FaultInjector"]:
        spec = (os.environ if env is None else env).get(FAULT_ENV, "")
        if not spec.strip():
            return None
        injector = cls(parse_faults(spec), rank)
        if rank == 0:
            print(f"verl_ds: fault injection from {FAULT_ENV}={spec!r}", file=sys.stderr, flush=True)
        return injector

    def _applies(self, f: Fault) -> bool:
        return (f.rank is None or f.rank == self.rank) and (f.steps is None or self.step in f.steps)

    def on_event(self, point: str, step: int) -> None:
        """A trainer event: ``step_begin`` or a checkpoint point (``step`` is the step being run or saved)."""
        self.step = step
        self(point)

    def __call__(self, point: str) -> None:
        for f in self.faults:
            if f.action == "nan_logits" or f.point != point or not self._applies(f):
                continue
            where = f"{point}, step {self.step}, rank {self.rank}"
            print(f"verl_ds: injected fault: {f.action} at {where}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if f.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.action == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os.kill(os.getpid(), getattr(signal, "SIG" + f.options["sig"]))

    def attach(self, actor_module: torch.nn.Module) -> None:
        """Hook the actor's HF module for ``nan_logits`` faults (no-op without one)."""
        phases = {f.options["phase"] for f in self.faults if f.action == "nan_logits"}
        if self._hook is None and phases - {"sampling"}:
            self._hook = actor_module.register_forward_hook(self._scoring_logits, with_kwargs=True)
        if self._sampling_hook is None and "sampling" in phases:
            # generation runs on a replica of the actor (rollout.gather_params), built at the first rollout: every
            # module's forward is watched for a causal LM's output drawn from with the cache
            self._sampling_hook = torch.nn.modules.module.register_module_forward_hook(self._sampling_logits,
                                                                                       with_kwargs=True)

    def _scoring_logits(self, module, args, kwargs, output):
        if kwargs.get("use_cache") is not False:  # generate() runs with the cache: that is the sampling phase
            return None
        return self._nan_logits("update" if torch.is_grad_enabled() else "rollout", kwargs, output)

    def _sampling_logits(self, module, args, kwargs, output):
        if kwargs.get("use_cache") is False or not hasattr(output, "logits"):
            return None
        return self._nan_logits("sampling", kwargs, output)

    def _nan_logits(self, phase: str, kwargs: dict, output):
        for f in self.faults:
            key = (id(f), self.step, phase)
            if f.action != "nan_logits" or f.options["phase"] != phase or not self._applies(f) or key in self._fired:
                continue
            logits = output.logits if hasattr(output, "logits") else output[0]
            i, pos = f.options["sample"], f.options["pos"]
            if i >= logits.shape[0]:
                continue
            self._fired.add(key)
            logits = logits.clone()
            if phase != "sampling" and "logits_to_keep" in kwargs:  # the last R + 1 positions: column t predicts
                logits[i, min(pos, logits.shape[1] - 1)] = float("nan")  # response token t
            else:  # the whole row (generate's forward may keep one position or all)
                logits[i] = float("nan")
            print(f"verl_ds: injected fault: NaN logits (sample {i}, response position {pos}, {phase} forward) at "
                  f"step {self.step}, rank {self.rank}", file=sys.stderr, flush=True)
            if hasattr(output, "logits"):
                output.logits = logits
                return output
            return (logits, *output[1:])
        return None


def install_from_env(rank: int, add_event_listener, module, env=None) -> Optional[FaultInjector]:
    """Subscribe the faults of ``VERL_DS_FAULT`` (if any) to a job's events (``add_event_listener``) and the actor's
    ``module``; returns the injector or None."""
    injector = FaultInjector.from_env(rank, env)
    if injector is not None:
        add_event_listener(injector.on_event)
        injector.attach(module)
    return injector
