"""The non-finite guard: a NaN/Inf skips an update on every rank, is counted, and leaves a forensic record
(``<run>/nonfinite/step_<N>.json``); ``max_bad_steps`` bad steps in a row stop the job with ``NonFiniteError``.
A step to skip is back-propagated as NaN so that the engine drops it. Details: docs/reliability.md."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Optional

import torch

from verl_ds import dist as vdist

log = logging.getLogger(__name__)

# Batch fields in the order a step computes them: the first one holding a non-finite value is the origin.
PIPELINE = ("rollout_log_probs", "old_log_probs", "ref_log_probs", "values", "scores", "token_rewards",
            "advantages", "returns")
_MAX_SAMPLES = 64  # samples listed per rank in a forensic record
_HINTS = {
    "rollout_log_probs": "sampling produced non-finite log-probs: the actor's logits were NaN/Inf during generation",
    "old_log_probs": "the actor's log-probs (its logits) were non-finite: the model produced NaN/Inf",
    "ref_log_probs": "the reference model's log-probs were non-finite",
    "values": "the critic's values were non-finite",
    "scores": "the task scores were non-finite: a reward model returned NaN/Inf",
    "token_rewards": "the token rewards (score - kl_coef * KL) were non-finite: look at the KL and kl_coef",
    "advantages": "the advantage estimator produced non-finite advantages",
    "returns": "the advantage estimator produced non-finite returns",
}


class NonFiniteError(RuntimeError):
    """``max_bad_steps`` consecutive steps had non-finite values; ``record`` is the last forensic record."""

    def __init__(self, message: str, record: Optional[str]):
        super().__init__(message)
        self.record = record


def is_finite(x) -> bool:
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x.detach()).all())
    return x is None or math.isfinite(float(x))


def json_float(x: float):
    x = float(x)
    return x if math.isfinite(x) else str(x)  # strict JSON has no NaN/Infinity


class NonFiniteGuard:
    """Per step, in order: ``begin_step``, ``skip_batch`` before the updates, ``skip_update`` before each backward,
    ``after_update`` after each optimizer step, ``end_step`` for the metrics, ``raise_if_exhausted`` after logging."""

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
        self._skipped = 0
        self._events: list[dict] = []
        self._losses: list = []  # this rank's losses since the last accumulation boundary (0-d tensors)
        self._updates: dict[str, int] = {}
        self.sampling_error: Optional[str] = None

    def skip_batch(self, batch, planned_updates: int = 0) -> bool:
        """Whether to skip this step's updates (collective): True on every rank when any rank's batch is non-finite or
        missing (sampling failed)."""
        local = batch is not None and any(f in batch and batch[f] is not None and not is_finite(batch[f])
                                          for f in PIPELINE)
        self._bad_batch = vdist.any_rank(local or self.sampling_error is not None)
        if self._bad_batch:
            self._skipped += planned_updates
        return self._bad_batch

    def skip_update(self, loss: torch.Tensor, at_boundary: bool) -> bool:
        """Whether to skip the step this micro-batch completes; a collective at the accumulation boundary only."""
        self._losses.append(loss.detach().float().reshape(-1)[:1])
        if not at_boundary:
            return False
        bad = ~torch.isfinite(torch.cat(self._losses))
        local = bool(bad.any())
        self._losses = [x for x, b in zip(self._losses, bad.tolist()) if b]  # the non-finite ones, for the record
        return vdist.any_rank(local)

    def after_update(self, role: str, result: dict, bad_loss: bool) -> None:
        """Record an optimizer step; one applied despite a bad loss or gradient norm is a NonFiniteError."""
        index = self._updates[role] = self._updates.get(role, 0) + 1
        grad_norm = result["grad_norm"]
        bad_norm = grad_norm is not None and not is_finite(grad_norm)
        losses, self._losses = [float(x) for x in self._losses], []
        if not (bad_loss or bad_norm):
            return
        self._events.append({"rank": self.rank, "role": role, "update": index, "skipped": bool(result["skipped"]),
                             "nonfinite_losses": [json_float(x) for x in losses],
                             "grad_norm": None if grad_norm is None else json_float(grad_norm)})
        if not result["skipped"]:  # this set-up does not check gradients: the parameters are now unusable
            raise NonFiniteError(f"{role} update {index}: DeepSpeed applied an update from non-finite gradients "
                                 f"(zero stage {result.get('zero_stage')}); resume from the last checkpoint with a "
                                 "set-up whose optimizer checks gradients (ZeRO 1-3)", None)
        self._skipped += 1

    def end_step(self, step: int, batch, responses: Optional[list] = None) -> dict:
        """Metrics of the step; writes the forensic record (a collective) when the step was bad on any rank."""
        bad = self._bad_batch or vdist.any_rank(bool(self._events))
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
        local = {"samples": scan_batch(batch, responses, self.rank), "events": self._events,
                 "sampling_error": self.sampling_error}
        gathered = vdist.gather_object(local)
        path = os.path.join(self.record_dir, f"step_{step}.json")
        if self.rank == 0:
            samples = [s for part in gathered for s in part["samples"]]
            counts: dict = {}
            for s in samples:
                for f, pos in s["nonfinite"].items():
                    c = counts.setdefault(f, {"samples": 0, "tokens": 0})
                    c["samples"] += 1
                    c["tokens"] += len(pos)
            errors = [p["sampling_error"] for p in gathered if p["sampling_error"]]
            origin = "sampling" if errors else next((f for f in PIPELINE if f in counts), None)
            record = {
                "step": step, "time": time.time(), "world_size": self.world_size,
                "kind": "batch" if self._bad_batch else "update",
                "origin": origin, "hint": _hint(origin, self._bad_batch, errors),
                "consecutive_bad_steps": self.consecutive, "max_bad_steps": self.max_bad_steps,
                "updates_skipped": self._skipped, "fields": counts,
                "update_events": [e for part in gathered for e in part["events"]],
                # samples where the problem starts first, then the rest
                "samples": sorted(samples, key=lambda s: (origin not in s["nonfinite"], s["rank"], s["index"])),
            }
            from verl_ds.checkpoint import fsync_write

            os.makedirs(self.record_dir, exist_ok=True)
            fsync_write(path, json.dumps(record, indent=1).encode())
        vdist.barrier()
        return path


def _hint(origin: Optional[str], bad_batch: bool, sampling_errors: list) -> str:
    if sampling_errors:
        return ("sampling failed (the next-token distribution was not a valid probability distribution: NaN/Inf "
                f"logits): {sampling_errors[0]}")
    if not bad_batch:
        return ("the rollout batch was finite; the loss or gradients became non-finite in the update's forward/"
                "backward (overflow in low precision, a too large learning rate, or bad logits under grad)")
    return _HINTS.get(origin, "no field holds a non-finite value on any rank")


def scan_batch(batch, responses: Optional[list] = None, rank: int = 0, limit: int = _MAX_SAMPLES) -> list[dict]:
    """This rank's samples holding a non-finite value in a PIPELINE field: positions per field and the reward."""
    if batch is None:
        return []
    bad_rows: dict[int, dict] = {}
    for f in PIPELINE:
        t = batch[f] if f in batch else None
        if t is None:
            continue
        bad = ~torch.isfinite(t.detach())
        for i in bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist():
            bad_rows.setdefault(i, {})[f] = bad[i].reshape(-1).nonzero().flatten().tolist()
    prompts = batch.extras.get("prompt")
    out = []
    for i in sorted(bad_rows)[:limit]:
        entry = {"rank": rank, "index": i, "nonfinite": bad_rows[i]}
        if batch.response_length is not None:
            entry["response_length"] = int(batch.response_length[i])
        if batch.done is not None:
            entry["ended_with_eos"] = bool(batch.done[i])
        if batch.scores is not None:
            entry["score"] = json_float(batch.scores[i].float().sum())  # the reward functions' total for the sample
        if batch.token_rewards is not None:
            entry["token_reward_sum"] = json_float(batch.token_rewards[i].float().sum())
        if prompts is not None:
            entry["prompt"] = str(prompts[i])
        if responses is not None:
            entry["response"] = str(responses[i])
        out.append(entry)
    return out
