"""Reliability: stop cleanly on preemption, skip non-finite updates with a forensic record, inject faults for
tests, and check paths at start-up.

- ``PreemptionHandler``: SIGTERM / SIGUSR1 (what Slurm sends at preemption and before the time limit) set
  a flag; at the next step boundary every rank agrees (a sum over ranks), the trainer saves a checkpoint
  and exits with ``PREEMPTED_EXIT_CODE`` (75, EX_TEMPFAIL), the status the sbatch scripts requeue on.
- ``NonFiniteGuard``: a rollout batch with non-finite log-probs/values/rewards/advantages skips the
  update on every rank; a non-finite loss or gradient norm skips that optimizer step on every rank. Each
  such step writes ``<run>/nonfinite/step_<N>.json`` (which samples, which token positions, their reward);
  ``max_bad_steps`` consecutive bad steps stop the job with ``NonFiniteError`` naming the record.
- ``FaultInjector``: faults from the ``VERL_DS_FAULT`` environment variable, so subprocess tests break
  real runs at chosen points (see ``parse_faults``).
- ``preflight``: model, tokenizer, data and reward paths, reward functions and the run directory are
  checked before anything is built; each problem is a ConfigError naming the key.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from verl_ds import dist as vdist
from verl_ds.config import ConfigError

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; slurm/train.sbatch requeues on it
FAULT_ENV = "VERL_DS_FAULT"
SAVE_POINTS = ("after_actor", "after_critic", "before_manifest", "before_latest")  # checkpoint.save's hooks
FAULT_POINTS = ("step_begin",) + SAVE_POINTS
# Batch fields in the order the step computes them: the first one holding a non-finite value is the origin.
PIPELINE = ("logprob", "ref_logprob", "value", "score", "reward", "advantage", "return")
_MAX_SAMPLES = 64  # samples listed per rank in a forensic record


class Preempted(SystemExit):
    """Raised by the trainer after the preemption checkpoint; the process exits with PREEMPTED_EXIT_CODE."""

    def __init__(self, signal_name: str, step: int, checkpoint: Optional[str]):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        self.message = (f"verl_ds: {signal_name} received: stopped after step {step}, {saved}; exiting with "
                        f"{PREEMPTED_EXIT_CODE} so the job is requeued (trainer.resume=auto continues)")


class NonFiniteError(RuntimeError):
    """``max_bad_steps`` consecutive steps had non-finite values; ``record`` is the last forensic record."""

    def __init__(self, message: str, record: Optional[str]):
        super().__init__(message)
        self.record = record


# --------------------------------------------------------------------------- preemption


class PreemptionHandler:
    """Turns SIGTERM / SIGUSR1 into a stop request that the training loop honours at a step boundary."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: Optional[str] = None
        self.received_at: Optional[float] = None
        self._previous: dict = {}

    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1 will not stop training cleanly")
            return self
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # no I/O here: the main thread may be inside a write to the same stream
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, time.time()

    def stop_requested(self) -> Optional[str]:
        """Collective: the signal's name on every rank when any rank got one, else None."""
        if not _any_rank(self.received is not None):
            return None
        return self.received or "a preemption signal (on another rank)"


class RankFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering; the message says what to do."""


_PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Timed out", "timed out", "Broken pipe",
                 "NCCL communicator was aborted", "Socket Timeout", "recvBytes", "Connection refused")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because of another rank (gloo/NCCL errors, their timeouts)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(exc)
    return (dist_error and isinstance(exc, dist_error)) or (
        isinstance(exc, RuntimeError) and any(k in text for k in _PEER_FAILURE)
        and ("gloo" in text or "nccl" in text.lower() or "c10d" in text))


def explains_rank_failures(method):
    """Decorate a trainer method: a collective failing because of another rank becomes RankFailure, with what
    happened (dead or silent for ``trainer.dist_timeout_s``) and the checkpoint to continue from."""

    @functools.wraps(method)
    def wrapper(trainer, *args, **kwargs):
        try:
            return method(trainer, *args, **kwargs)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            from verl_ds.checkpoint import find_resumable

            what = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0]).split(". This is typically")[0][:200]
            msg = (f"rank {vdist.rank()}: a collective failed because another rank died or stopped answering for "
                   f"trainer.dist_timeout_s={trainer.cfg.trainer.dist_timeout_s} s ({what}). The other ranks' logs "
                   f"say why. Last complete checkpoint: "
                   f"{find_resumable(trainer.ckpt_root) or 'none'}; restart the job (trainer.resume=auto continues)")
            print(f"verl_ds: error: {msg}", file=sys.stderr, flush=True)
            raise RankFailure(msg) from exc

    return wrapper


# --------------------------------------------------------------------------- the non-finite guard


def _finite(x) -> bool:
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x.detach()).all())
    return x is None or math.isfinite(float(x))


def _any_rank(local: bool) -> bool:
    """Collective: whether ``local`` is True on any rank (NCCL only reduces CUDA tensors)."""
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    flag = torch.tensor([1.0 if local else 0.0], device="cuda" if nccl else "cpu")
    return vdist.all_reduce_sum(flag).item() > 0


def _json_float(x: float):
    x = float(x)
    return x if math.isfinite(x) else str(x)  # strict JSON has no NaN/Infinity


class NonFiniteGuard:
    """Skips non-finite updates consistently on every rank, counts them and writes forensic records.

    Per step: ``begin_step()``; ``check_batch(batch)`` before the updates (skip them all when it returns
    True); ``backward_and_step(engine, loss, role)`` in place of ``engine.backward(loss); engine.step()``;
    ``end_step(step, batch, responses)`` for the metrics; ``raise_if_exhausted()`` after logging them.
    """

    def __init__(self, max_bad_steps: int, run_dir: str, rank: int = 0, world_size: int = 1):
        if isinstance(max_bad_steps, bool) or not isinstance(max_bad_steps, int) or max_bad_steps < 1:
            raise ValueError(f"max_bad_steps: expected an int >= 1, got {max_bad_steps!r}")
        self.max_bad_steps, self.rank, self.world_size = max_bad_steps, rank, world_size
        self.record_dir = os.path.join(run_dir, "nonfinite")
        self.total_bad_steps = 0
        self.consecutive = 0
        self.last_record: Optional[str] = None
        self.begin_step()

    def begin_step(self) -> None:
        self._bad_batch = False
        self._planned_updates = 0
        self._skipped = 0
        self._events: list[dict] = []
        self._losses: list[float] = []  # this rank's non-finite micro-batch losses since the last boundary
        self._updates: dict[str, int] = {}

    # ---- the rollout batch ------------------------------------------------------------------
    def check_batch(self, batch, planned_updates: int = 0) -> bool:
        """Collective: True on every rank when any rank's batch holds a non-finite value (then skip the update)."""
        local = any(batch[f] is not None and not _finite(batch[f]) for f in PIPELINE)
        self._bad_batch = _any_rank(local)
        if self._bad_batch:
            self._skipped += planned_updates
        return self._bad_batch

    # ---- optimizer steps --------------------------------------------------------------------
    def backward_and_step(self, engine, loss: torch.Tensor, role: str) -> bool:
        """``engine.backward(loss); engine.step()``, with the update skipped on every rank when any rank had a
        non-finite loss since the last accumulation boundary or the global gradient norm is non-finite.
        Returns True when an update was skipped.

        The decision is summed over ranks before the boundary micro-batch's backward. To skip, that backward
        gets a NaN loss, so every gradient is NaN on every rank and DeepSpeed's own check (ZeRO 1-3: a
        non-finite global norm) drops the step, clears the gradients and keeps its counters consistent; a
        NaN loss alone can leave the gradients finite (masked positions), which would apply the update.
        Without ZeRO nothing checks, so the gradients are dropped instead (the optimizer skips grad-less
        parameters).
        """
        if not _finite(loss):
            self._losses.append(float(loss.detach().float().sum()))
        boundary = engine.is_gradient_accumulation_boundary()
        bad_loss = boundary and _any_rank(bool(self._losses))
        zero = engine.zero_optimization_stage() > 0
        engine.backward(loss * float("nan") if bad_loss and zero else loss)
        if bad_loss and not zero:
            for p in engine.module.parameters():
                p.grad = None
        skipped_before = engine.skipped_steps
        engine.step()
        if not boundary:
            return False
        index = self._updates[role] = self._updates.get(role, 0) + 1
        norm = engine.get_global_grad_norm()
        bad_norm = norm is not None and not _finite(norm)
        losses, self._losses = self._losses, []
        if not (bad_loss or bad_norm):
            return False
        skipped = engine.skipped_steps > skipped_before or (bad_loss and not zero)
        self._events.append({"rank": self.rank, "role": role, "update": index, "skipped": skipped,
                             "nonfinite_losses": [_json_float(x) for x in losses],
                             "grad_norm": None if norm is None else _json_float(norm)})
        if not skipped:  # this DeepSpeed set-up does not check gradients: the parameters are now unusable
            raise NonFiniteError(f"{role} update {index}: DeepSpeed applied an update from non-finite gradients "
                                 f"(zero stage {engine.zero_optimization_stage()}); resume from the last checkpoint "
                                 "with a set-up whose optimizer checks gradients (ZeRO 1-3)", None)
        self._skipped += 1
        return True

    # ---- end of step ------------------------------------------------------------------------
    def end_step(self, step: int, batch, responses: Optional[list] = None) -> dict:
        """Metrics of the step; writes the forensic record (a collective) when the step was bad on any rank."""
        bad = self._bad_batch or _any_rank(bool(self._events))
        if bad:
            self.consecutive += 1
            self.total_bad_steps += 1
            self.last_record = self._write_record(step, batch, responses)
            log.warning("step %d: non-finite values (%d consecutive bad step(s) of max %d); %d update(s) skipped; "
                        "forensic record %s", step, self.consecutive, self.max_bad_steps, self._skipped,
                        self.last_record)
        else:
            self.consecutive = 0
        return {"training/nonfinite_steps": float(self.total_bad_steps), "training/skipped_updates": float(self._skipped),
                "training/consecutive_bad_steps": float(self.consecutive)}

    def raise_if_exhausted(self) -> None:
        if self.consecutive >= self.max_bad_steps:
            raise NonFiniteError(f"{self.consecutive} consecutive steps with non-finite values "
                                 f"(trainer.max_bad_steps={self.max_bad_steps}); stopping. Last forensic record: "
                                 f"{self.last_record}", self.last_record)

    def state_dict(self) -> dict:
        return {"total_bad_steps": self.total_bad_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total_bad_steps = int(state.get("total_bad_steps", 0))
        self.consecutive = int(state.get("consecutive", 0))

    def _write_record(self, step: int, batch, responses) -> str:
        local = {"samples": scan_batch(batch, responses, self.rank), "events": self._events}
        gathered = _gather(local)
        path = os.path.join(self.record_dir, f"step_{step}.json")
        if self.rank == 0:
            samples = [s for part in gathered for s in part["samples"]]
            counts = {}
            for s in samples:
                for f, pos in s["nonfinite"].items():
                    c = counts.setdefault(f, {"samples": 0, "tokens": 0})
                    c["samples"] += 1
                    c["tokens"] += len(pos)
            origin = next((f for f in PIPELINE if f in counts), None)
            record = {
                "step": step, "time": time.time(), "world_size": self.world_size,
                "kind": "batch" if self._bad_batch else "update",
                "origin": origin, "hint": _hint(origin, self._bad_batch),
                "consecutive_bad_steps": self.consecutive, "max_bad_steps": self.max_bad_steps,
                "updates_skipped": self._skipped,
                "fields": counts,
                "update_events": [e for part in gathered for e in part["events"]],
                # samples where the problem starts first, then the rest
                "samples": sorted(samples, key=lambda s: (origin not in s["nonfinite"], s["rank"], s["index"])),
            }
            from verl_ds.checkpoint import fsync_write

            os.makedirs(self.record_dir, exist_ok=True)
            fsync_write(path, json.dumps(record, indent=1).encode())
        vdist.barrier()
        return path


def _hint(origin: Optional[str], bad_batch: bool) -> str:
    if not bad_batch:
        return ("the rollout batch was finite; the loss or gradients became non-finite in the update's forward/"
                "backward (overflow in low precision, a too large learning rate, or bad logits under grad)")
    return {
        "logprob": "the actor's log-probs (its logits) were non-finite: the model produced NaN/Inf",
        "ref_logprob": "the reference model's log-probs were non-finite",
        "value": "the critic's values were non-finite",
        "score": "the task scores were non-finite: a reward model returned NaN/Inf",
        "reward": "the token rewards (score - kl_coef * KL) were non-finite: look at the KL and kl_coef",
        "advantage": "GAE/whitening produced non-finite advantages",
        "return": "GAE produced non-finite returns",
    }.get(origin, "no field holds a non-finite value on any rank")


def scan_batch(batch, responses: Optional[list] = None, rank: int = 0, limit: int = _MAX_SAMPLES) -> list[dict]:
    """This rank's samples holding a non-finite value in a PIPELINE field: positions per field and the reward."""
    bad_rows: dict[int, dict] = {}
    for f in PIPELINE:
        t = batch[f]
        if t is None:
            continue
        bad = ~torch.isfinite(t.detach())
        for i in bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist():
            bad_rows.setdefault(i, {})[f] = bad[i].reshape(-1).nonzero().flatten().tolist()
    prompts = batch.extras.get("prompt") if hasattr(batch, "extras") else None
    out = []
    for i in sorted(bad_rows)[:limit]:
        entry = {"rank": rank, "index": i, "nonfinite": bad_rows[i]}
        if batch.response_length is not None:
            entry["response_length"] = int(batch.response_length[i])
        if batch.done is not None:
            entry["ended_with_eos"] = bool(batch.done[i])
        if batch.score is not None:
            entry["score"] = _json_float(batch.score[i].float().sum())  # the reward functions' total for the sample
        if batch.reward is not None:
            entry["token_reward_sum"] = _json_float(batch.reward[i].float().sum())
        if prompts is not None:
            entry["prompt"] = str(prompts[i])
        if responses is not None:
            entry["response"] = str(responses[i])
        out.append(entry)
    return out


def _gather(obj) -> list:
    if vdist.world_size() == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * vdist.world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- fault injection


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
    """Parse ``VERL_DS_FAULT``: faults separated by ``;``, each ``action=value`` then ``:key=value`` options.

    kill_at=<point>[:step=N][:rank=R]     SIGKILL this process at a fault point
    hang_at=<point>[:step=N][:rank=R]     SIGSTOP this process (alive, sockets open, never answers)
    signal_at=<point>[:sig=TERM|USR1][:step=N][:rank=R]   send a signal to this process
    nan_logits_at_step=<steps>[:rank=R][:sample=I][:pos=T][:phase=rollout|update]
        NaN in the actor's logits of sample I, response position T, in the first forward of the step's
        log-prob pass (rollout, no grad) or of its PPO update (update, with grad); rank defaults to 0.
    Points: step_begin, after_actor, after_critic, before_manifest, before_latest (the last four are inside
    a checkpoint save; step is then the step being saved). Steps: 3, 3,5 or 4-6.
    """
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
            if phase not in ("rollout", "update"):
                raise ValueError(f"{FAULT_ENV}: {item!r}: phase must be rollout or update, got {phase!r}")
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
    """Carries out parsed faults in a real run: ``step_begin(step)`` each step, ``inj(point)`` as the
    checkpoint fault hook, ``attach(actor_module)`` for NaN logits."""

    def __init__(self, faults: list[Fault], rank: int = 0):
        self.faults, self.rank = list(faults), rank
        self.step = 0
        self._fired: set = set()
        self._hook = None

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

    def step_begin(self, step: int) -> None:
        self.step = step
        self("step_begin")

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
        if self._hook is None and any(f.action == "nan_logits" for f in self.faults):
            self._hook = actor_module.register_forward_hook(self._nan_logits, with_kwargs=True)

    def _nan_logits(self, module, args, kwargs, output):
        if kwargs.get("use_cache") is not False:  # generate() runs with the cache: never poison sampling
            return None
        phase = "update" if torch.is_grad_enabled() else "rollout"
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
            if "logits_to_keep" in kwargs:  # the last R + 1 positions: column t predicts response token t
                logits[i, min(pos, logits.shape[1] - 1)] = float("nan")
            else:
                logits[i] = float("nan")
            print(f"verl_ds: injected fault: NaN logits (sample {i}, response position {pos}, {phase} forward) at "
                  f"step {self.step}, rank {self.rank}", file=sys.stderr, flush=True)
            if hasattr(output, "logits"):
                output.logits = logits
                return output
            return (logits, *output[1:])
        return None


# --------------------------------------------------------------------------- start-up checks

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def _check_dir(key: str, path: Optional[str], need: tuple, what: str) -> None:
    if path is None:
        return
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {path!r} does not exist")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory (expected a local HF {what} directory)")
    if need and not any(os.path.isfile(os.path.join(path, n)) for n in need):
        raise ConfigError(f"{key}: {path!r} has no {what} files (looked for {', '.join(need)})"
                          + ("; point model.tokenizer_path at the tokenizer" if what == "tokenizer" else ""))


def preflight(cfg) -> None:
    """Check every path and reward function the job will need, before any model is built (ConfigError naming the key)."""
    from verl_ds.rewards import resolve_reward_fn

    m = cfg.model
    _check_dir("model.path", m.path, ("config.json",), "model")
    _check_dir("model.critic_path", m.critic_path, ("config.json",), "model")
    if m.tokenizer_path is not None:
        _check_dir("model.tokenizer_path", m.tokenizer_path, _TOKENIZER_FILES, "tokenizer")
    elif m.path is not None:
        _check_dir("model.path", m.path, _TOKENIZER_FILES, "tokenizer")
    _check_dir("reward.model_path", cfg.reward.model_path, ("config.json",), "model")
    for key, path in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"{key}: {path!r} does not exist")
    for i, spec in enumerate(cfg.reward.functions):
        name = spec if isinstance(spec, str) else spec.get("name")
        try:
            resolve_reward_fn(name)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"reward.functions[{i}]: {exc}") from None
    out = cfg.trainer.output_dir
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"trainer.output_dir: cannot create {out!r} ({exc.strerror})") from None
    if not os.path.isdir(out) or not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"trainer.output_dir: {out!r} is not a writable directory")


def write_data_report(run_dir: str, datasets: dict) -> str:
    """``<run>/data_report.json``: rows read, kept, and skipped/truncated counts by reason, per data set."""
    report = {name: {"source": ds.source, "rows": ds.n_rows, "kept": len(ds), "problems": ds.report(),
                     "summary": ds.summary()} for name, ds in datasets.items() if ds is not None}
    path = os.path.join(run_dir, "data_report.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    return path
