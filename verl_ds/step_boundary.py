"""The step boundary, where control-plane changes take effect on every rank at once: rank 0 applies them atomically
with bumping ``global_step`` (the step announced to the client); a reward swap failing on any rank is rolled back
everywhere. Journal, audit log, replay on resume: docs/http_api.md, docs/reliability.md "Hot changes across a crash"."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Callable, Optional

from verl_ds import dist as vdist

log = logging.getLogger(__name__)

AUDIT_FILE = "state_changes.jsonl"
JOURNAL_FILE = "staged_changes.jsonl"


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _on_every_rank(fn: Callable, arg) -> tuple:
    """Collective: (``fn(arg)`` or None, ["rank r: reason"] of every rank where it raised). All but KeyboardInterrupt
    is caught: a reward's own code ran (SystemExit from a module's import included)."""
    out, error = None, None
    try:
        out = fn(arg)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - see the docstring: nothing a reward raises may end the run
        error = _reason(exc)
    return out, [f"rank {r}: {e}" for r, e in enumerate(vdist.gather_object(error)) if e]


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("key"), str):
                out.append(rec)
    return out


class StepBoundary:
    """Owns the staged reward swap, the journal, the audit log and the replay schedule. ``check_swap`` normalises a
    request (no user code runs); ``build_reward`` runs on every rank at the same boundary (a neural scorer's engine is
    a collective); ``probe`` raises when the built reward cannot score this run's data."""

    def __init__(self, state, run_dir: str, build_reward: Callable[[dict], object],
                 install: Callable[[object], None], reward_spec: dict, check_swap: Callable[[dict], dict],
                 probe: Optional[Callable[[object], None]] = None):
        self.state, self.run_dir, self._check_swap = state, run_dir, check_swap
        self._build_reward, self._install, self._probe = build_reward, install, probe
        self.is_main = state.rank == 0
        self.reward_spec = dict(reward_spec)
        self._lock = threading.Lock()
        self._pending_swap: Optional[dict] = None
        self._replay: dict[int, list[dict]] = {}  # step -> audited or journaled records to apply again
        self._closed = False
        if self.is_main:
            state.on_stage = self._journal_state

    # ---- the HTTP thread (rank 0) ------------------------------------------------------------------
    def stage_reward_swap(self, spec: dict, client: str = "") -> dict:
        """Validate, journal and queue a reward swap for the next boundary (rank 0, HTTP thread); returns the
        announcement. A swap still queued is replaced (audited as dropped)."""
        request = {**self._check_swap(spec), "client": client, "id": uuid.uuid4().hex}
        with self.state.lock, self._lock:  # the same lock order as cross()
            applies_at = self.state.get("global_step") + 1
            self._append(JOURNAL_FILE, [{"id": request["id"], "step": applies_at, "key": "reward",
                                         "spec": self._spec(request), "client": client}])
            replaced, self._pending_swap = self._pending_swap, request
            if replaced is not None:
                self._audit([self._dropped_swap(replaced, f"replaced by the swap {request['id']} staged for the "
                                                          "same step")], applies_at)
        return {"staged": self._spec(request), "applies_at_step": applies_at}

    def _journal_state(self, items: list[dict], applies_at: int) -> None:
        self._append(JOURNAL_FILE, [{"id": i["id"], "step": applies_at, "key": i["key"], "new": i["value"],
                                     "client": i["client"]} for i in items])

    # ---- every rank, once per step -------------------------------------------------------------------
    def cross(self) -> int:
        """Start the next step: apply staged changes and swaps on every rank; returns the new global step."""
        st = self.state
        swaps, changes = [], []
        if self.is_main:
            with st.lock:
                step = st.get("global_step") + 1
                replayed = self._replay.pop(step, [])
                changes = self._replayed_state_changes([r for r in replayed if r["key"] != "reward"])
                changes += st.apply_staged()
                with self._lock:
                    staged, self._pending_swap = self._pending_swap, None
                st.set("global_step", step)
            self._audit(changes, step)
            # a replayed swap first: a swap staged over HTTP for the same step was asked for later
            swaps = self._replayed_swaps([r for r in replayed if r["key"] == "reward"], step)
            swaps += [staged] if staged is not None else []
        for swap in vdist.broadcast_object(swaps):
            self._swap(swap)
        st.sync()
        return st.get("global_step")

    def uncross(self, step: int) -> None:
        """Undo ``cross`` into a ``step`` that failed before any update (collective); the values it applied stay."""
        if self.is_main:
            self.state.set("global_step", step - 1)
        self.state.sync()

    def _swap(self, request: dict, restore: bool = False) -> bool:
        """Build, try and install a swap on every rank (collective); roll it back everywhere when any rank fails."""
        spec = self._spec(request)
        reward, errors = _on_every_rank(self._build_reward, spec)
        if not errors and self._probe is not None:  # only once built everywhere: a scorer's forward is a collective
            _, errors = _on_every_rank(self._probe, reward)
        step = self.state.get("global_step")
        tags = {k: True for k in ("replayed", "resume") if request.get(k)} | ({"resume": True} if restore else {})
        tags.update({"id": request["id"]} if request.get("id") else {})
        if errors:  # built or tried nowhere or not everywhere: the previous reward stays active on every rank
            if reward is not None and hasattr(reward, "close"):
                reward.close()
            log.error("step %d: reward swap refused at the step boundary, the previous reward stays: %s", step,
                      "; ".join(errors))
            if self.is_main:
                self._audit([{"key": "reward", "old": self.state.get("reward_name"), "new": None,
                              "client": request.get("client", ""), "spec": spec, "refused": "; ".join(errors),
                              **tags}], step)
            return False
        self._install(reward)
        self.reward_spec = spec
        if self.is_main and not restore:
            from verl_ds.builder import reward_name

            name = reward_name(spec["functions"], spec.get("model_path"))
            old = (self.state.get("reward_version"), self.state.get("reward_name"))
            self.state.update({"reward_version": old[0] + 1, "reward_name": name})
            self._audit([{"key": "reward", "old": old[1], "new": name, "client": request.get("client", ""),
                          "spec": spec, **tags}], step)
        return True

    def restore(self, spec: dict) -> bool:
        """Reactivate a checkpoint's reward on resume (collective), tried like a swap; returns whether it took."""
        request, error = None, None
        if self.is_main:
            try:
                request = {**self._check_swap(spec), "client": "", "resume": True}
            except (ValueError, TypeError) as exc:
                error = _reason(exc)
        request = vdist.broadcast_object(request)
        if request is not None and self._swap(request, restore=True):
            return True
        if self.is_main:  # the checkpoint's SharedState names the reward that was refused
            from verl_ds.builder import reward_name

            self.state.set("reward_name", reward_name(self.reward_spec["functions"], self.reward_spec.get("model_path")))
            if request is None:
                log.error("resume: the checkpoint's reward %s is refused (%s); the current reward stays", spec, error)
                self._audit([{"key": "reward", "old": None, "new": None, "client": "", "spec": spec, "resume": True,
                              "refused": error}], self.state.get("global_step"))
        return False

    @staticmethod
    def _spec(request: dict) -> dict:
        return {k: v for k, v in request.items() if k not in ("client", "replayed", "resume", "id")}

    def _dropped_swap(self, request: dict, why: str) -> dict:
        return {"key": "reward", "old": self.state.get("reward_name"), "new": None, "client": request.get("client", ""),
                "spec": self._spec(request), "id": request.get("id"), "dropped": why}

    def close(self, completed: bool) -> None:
        """End of run (rank 0): changes still staged are audited as dropped if ``completed``, else kept for a resume."""
        if not self.is_main or self._closed:
            return
        self._closed = True
        if not completed:
            return
        step = self.state.get("global_step")
        why = f"the run ended at step {step} (trainer.total_steps) before the step it was staged for"
        records = [{"key": s["key"], "old": self.state.get(s["key"]), "new": s["value"], "client": s["client"],
                    "id": s.get("id"), "dropped": why} for s in self.state.staged()]
        with self._lock:
            swap, self._pending_swap = self._pending_swap, None
        records += [self._dropped_swap(swap, why)] if swap is not None else []
        self._audit(records, step + 1)

    # ---- journal, audit and replay ---------------------------------------------------------------------
    def _append(self, name: str, records: list, step: Optional[int] = None) -> None:
        if not records:
            return
        path = os.path.join(self.run_dir, name)
        now = time.time()
        lines = "".join(json.dumps({"time": now, **({} if step is None else {"step": step}), **r}, default=str) + "\n"
                        for r in records)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(lines)

    def _audit(self, records: list, step: int) -> None:
        self._append(AUDIT_FILE, records, step)

    def schedule_replay(self, resumed_step: int) -> int:
        """Plan to re-apply at their steps the changes audited after ``resumed_step`` and the journaled ones no audit
        settles (rank 0); journaled ones at or before it are audited as dropped. Returns how many are scheduled."""
        self._replay = {}
        if not self.is_main:
            return 0
        settled: dict = {}  # id (or (step, key) for lines without one) -> its latest audit line
        with self._lock:  # still queued in this process (a fall-back resume): the queue applies them
            queued = {s["id"] for s in self.state.staged()} | {(self._pending_swap or {}).get("id")} - {None}
        for rec in _read_jsonl(os.path.join(self.run_dir, AUDIT_FILE)):
            settled[rec.get("id") or (rec["step"], rec["key"])] = rec
        plan = [rec for rec in settled.values()
                if rec["step"] > resumed_step and not rec.get("refused") and not rec.get("dropped")]
        lost = []
        for entry in _read_jsonl(os.path.join(self.run_dir, JOURNAL_FILE)):
            if entry.get("id") in settled or entry.get("id") in queued:
                continue
            settled[entry.get("id")] = entry
            if entry["step"] > resumed_step:
                plan.append({**entry, "journaled": True})
            else:
                lost.append(entry)
        for rec in sorted(plan, key=lambda r: r["step"]):  # stable: within a step, the order they were applied in
            self._replay.setdefault(rec["step"], []).append(rec)
        for entry in lost:
            self._audit([{"key": entry["key"], "old": None, "new": entry.get("new"), "client": entry.get("client", ""),
                          "id": entry.get("id"), **({"spec": entry["spec"]} if "spec" in entry else {}),
                          "dropped": f"staged for step {entry['step']}, which the run passed without applying it "
                                     f"(lost in a crash); resumed from step {resumed_step}"}], entry["step"])
        n = len(plan)
        if n:
            log.info("resume: replaying %d hot change(s) for steps after %d at their original steps", n, resumed_step)
        return n

    def _replayed_state_changes(self, records: list[dict]) -> list[dict]:
        from verl_ds.state import HOT_KEYS

        out = []
        for rec in records:
            key = rec["key"]
            base = {"key": key, "client": rec.get("client", ""), "replayed": True,
                    **({"id": rec["id"]} if rec.get("id") else {})}
            try:
                if key not in HOT_KEYS:
                    raise ValueError(f"{key!r} is not a hot-updatable key")
                old = self.state.get(key)
                self.state.update({key: rec["new"]})  # validated against this run's ranges and limits
                out.append({**base, "old": old, "new": rec["new"]})
            except (ValueError, KeyError) as exc:  # StateValidationError is a ValueError
                log.error("resume: the replayed change %s=%r is refused (%s); it stays out", key, rec.get("new"), exc)
                out.append({**base, "old": None, "new": rec.get("new"), "refused": _reason(exc)})
        return out

    def _replayed_swaps(self, records: list[dict], step: int) -> list[dict]:
        out = []
        for rec in records:
            tags = {"client": rec.get("client", ""), "replayed": True, **({"id": rec["id"]} if rec.get("id") else {})}
            try:
                out.append({**self._check_swap(rec.get("spec")), **tags})  # checked again, with today's rules
            except (ValueError, TypeError) as exc:
                log.error("step %d: the replayed reward swap %s is refused (%s); the current reward stays", step,
                          rec.get("spec"), exc)
                self._audit([{"key": "reward", "old": self.state.get("reward_name"), "new": None,
                              "spec": rec.get("spec"), "refused": _reason(exc), **tags}], step)
        return out


class ScoredByEnvironment:
    """An agent run's reward swapper: its environment scores every trajectory, so a swap would change nothing and
    POST /v1/models/reward answers 400 saying so."""

    def __init__(self, environment: str):
        self.environment = environment

    def stage_reward_swap(self, spec: dict, client: str = "") -> dict:
        raise ValueError(f"this run is scored by its environment (agent.environment={self.environment!r}): a reward "
                         "swap would have no effect")


def start_control_server(sc, state, registry, run_dir, metrics_fn, reward_swapper, policy_vocab_size: int):
    """The /v1 control plane of the ``server`` section ``sc`` on rank 0 (a daemon thread; it never blocks the training
    loop); returns the server. ``reward_swapper``: the StepBoundary, or ScoredByEnvironment for an agent run."""
    from verl_ds.server import ControlServer

    server = ControlServer(state, registry, host=sc.host, port=sc.port, token=sc.token, run_dir=run_dir,
                           metrics_fn=metrics_fn, reward_swapper=reward_swapper,
                           swappable_rewards=sc.swappable_rewards, allow_reward_code=sc.allow_reward_code,
                           reward_model_dir=sc.reward_model_dir, policy_vocab_size=policy_vocab_size)
    url = server.start()
    print(f"verl_ds: control server at {url} (GET {url}/v1/models)", flush=True)
    return server
