"""The step boundary: where hot changes from the control plane take effect, on every rank at once.

At each boundary rank 0 applies the SharedState updates staged by the HTTP thread and takes the staged reward
swap, atomically with bumping ``global_step`` (a change staged concurrently lands wholly before or after it,
so the step announced to its client is the step it is applied at); then the swap is built on every rank and
the state is broadcast. A swap that fails to build on any rank is rolled back on every rank, logged and
audited as refused, and training goes on. Every applied or refused change is appended to
``<run>/state_changes.jsonl`` (time, step, key, old, new, client).

On resume from a checkpoint at step S, the changes audited as applied after S are replayed at their original
steps (and audited again with ``"replayed": true``), so a resumed run follows the same schedule of hot
changes as the run that crashed.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, Optional

from verl_ds import dist as vdist

log = logging.getLogger(__name__)

AUDIT_FILE = "state_changes.jsonl"


class StepBoundary:
    """Owns the staged reward swap, the audit log and the replay schedule (see the module docstring).

    check_swap(spec) validates a request (nothing imported or loaded) and returns it normalised; build_reward(request)
    builds the RewardModel of a swap request on this rank (every rank calls it at the
    same boundary: a neural scorer's engine is a collective) and raises on failure; install(reward) makes it
    the active reward. reward_spec is the active reward's spec (saved in checkpoints, rebuilt on resume).
    """

    def __init__(self, state, run_dir: str, build_reward: Callable[[dict], object],
                 install: Callable[[object], None], reward_spec: dict, check_swap: Callable[[dict], dict]):
        self.state, self.run_dir, self._check_swap = state, run_dir, check_swap
        self._build_reward, self._install = build_reward, install
        self.is_main = state.rank == 0
        self.reward_spec = dict(reward_spec)
        self._lock = threading.Lock()
        self._pending_swap: Optional[dict] = None
        self._replay: dict[int, list[dict]] = {}  # step -> audited records to apply again

    # ---- the HTTP thread (rank 0) ------------------------------------------------------------------
    def stage_reward_swap(self, spec: dict, client: str = "") -> dict:
        """Validate a reward swap request (``check_swap``) and queue it for the next step boundary (rank 0, the HTTP
        thread); returns the announcement."""
        request = {**self._check_swap(spec), "client": client}
        with self.state.lock, self._lock:  # the same lock order as cross()
            self._pending_swap = request
            applies_at = self.state.get("global_step") + 1
        return {"staged": {k: v for k, v in request.items() if k != "client"}, "applies_at_step": applies_at}

    # ---- every rank, once per step -------------------------------------------------------------------
    def cross(self) -> int:
        """Start the next step: apply staged changes and swaps on every rank; returns the new global step."""
        st = self.state
        swap, changes = None, []
        if self.is_main:
            with st.lock:
                step = st.get("global_step") + 1
                changes = self._replayed_state_changes(step) + st.apply_staged()
                with self._lock:
                    swap, self._pending_swap = self._pending_swap, None
                swap = self._replayed_swap(step) or swap
                st.set("global_step", step)
            self._audit(changes, step)
        swap = vdist.broadcast_object(swap)
        if swap is not None:
            self._swap(swap)
        st.sync()
        return st.get("global_step")

    def _swap(self, request: dict) -> None:
        spec = {k: v for k, v in request.items() if k not in ("client", "replayed")}
        reward, error = None, None
        try:
            reward = self._build_reward(spec)
        except Exception as exc:  # a request that validated but cannot be built here: refuse it, keep training
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        errors = [f"rank {r}: {e}" for r, e in enumerate(vdist.gather_object(error)) if e]
        step = self.state.get("global_step")
        if errors:  # built nowhere or not everywhere: the previous reward stays active on every rank
            if reward is not None and hasattr(reward, "close"):
                reward.close()
            log.error("step %d: reward swap refused at the step boundary, the previous reward stays: %s", step,
                      "; ".join(errors))
            if self.is_main:
                self._audit([{"key": "reward", "old": self.state.get("reward_name"), "new": None,
                              "client": request.get("client", ""), "spec": spec, "refused": "; ".join(errors)}], step)
            return
        self._install(reward)
        self.reward_spec = spec
        if self.is_main:
            from verl_ds.builder import reward_name

            name = reward_name(spec["functions"], spec.get("model_path"))
            old = (self.state.get("reward_version"), self.state.get("reward_name"))
            self.state.update({"reward_version": old[0] + 1, "reward_name": name})
            self._audit([{"key": "reward", "old": old[1], "new": name, "client": request.get("client", ""),
                          "spec": spec, **({"replayed": True} if request.get("replayed") else {})}], step)

    # ---- audit and replay ----------------------------------------------------------------------------
    def _audit(self, records: list, step: int) -> None:
        if not records:
            return
        path = os.path.join(self.run_dir, AUDIT_FILE)
        lines = "".join(json.dumps({"time": time.time(), "step": step, **r}, default=str) + "\n" for r in records)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(lines)

    def schedule_replay(self, resumed_step: int) -> int:
        """Read the audit log and plan to re-apply the changes applied after ``resumed_step`` (rank 0);
        returns how many changes are scheduled."""
        self._replay = {}
        path = os.path.join(self.run_dir, AUDIT_FILE)
        if not (self.is_main and os.path.isfile(path)):
            return 0
        latest: dict[tuple, dict] = {}  # (step, key) -> record: a change replayed before is the same change
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash
                if rec.get("step", 0) > resumed_step and not rec.get("refused"):
                    latest[(rec["step"], rec["key"])] = rec
        for (step, _), rec in sorted(latest.items(), key=lambda kv: kv[0][0]):
            self._replay.setdefault(step, []).append(rec)
        n = sum(len(v) for v in self._replay.values())
        if n:
            log.info("resume: replaying %d hot change(s) applied after step %d at their original steps", n,
                     resumed_step)
        return n

    def _replayed_state_changes(self, step: int) -> list[dict]:
        records = [r for r in self._replay.get(step, []) if r["key"] != "reward"]
        out = []
        for rec in records:
            old = self.state.get(rec["key"])
            self.state.update({rec["key"]: rec["new"]})
            out.append({"key": rec["key"], "old": old, "new": rec["new"], "client": rec.get("client", ""),
                        "replayed": True})
        return out

    def _replayed_swap(self, step: int) -> Optional[dict]:
        rec = next((r for r in self._replay.pop(step, []) if r["key"] == "reward" and r.get("spec")), None)
        return None if rec is None else {**rec["spec"], "client": rec.get("client", ""), "replayed": True}


def start_control_server(trainer):
    """The /v1 control plane on rank 0 (a daemon thread; it never blocks the training loop); returns the server."""
    from verl_ds.server import ControlServer

    sc = trainer.cfg.server
    server = ControlServer(trainer.state, trainer.registry, host=sc.host, port=sc.port, token=sc.token,
                           max_body_bytes=sc.max_body_bytes, run_dir=trainer.out_dir,
                           metrics_fn=trainer.metrics.snapshot, reward_swapper=trainer.boundary,
                           swappable_rewards=sc.swappable_rewards, allow_reward_code=sc.allow_reward_code,
                           reward_model_dir=sc.reward_model_dir, policy_vocab_size=len(trainer.tokenizer))
    url = server.start()
    print(f"verl_ds: control server at {url} (GET {url}/v1/models)", flush=True)
    return server
