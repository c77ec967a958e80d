"""Start real training ranks by hand (as srun does: one process per rank, RANK/WORLD_SIZE/MASTER_* set), so a
test can signal, kill or time each rank and read its own exit status (torchrun would replace it by its own)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from e2e_utils import FAST, ROOT, TRAIN, base_env, free_port, merged


class Job:
    """N rank processes of one training job; their output goes to ``<log_dir>/rank<r>.log``."""

    def __init__(self, procs: list, logs: list, output_dir: str):
        self.procs, self.logs, self.output_dir = procs, logs, output_dir
        self.exit_times: dict[int, float] = {}

    def poll(self) -> list:
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            if p.poll() is not None and r not in self.exit_times:
                self.exit_times[r] = now
        return [p.returncode for p in self.procs]

    def wait(self, timeout: float) -> list:
        """Exit codes of every rank (negative: killed by that signal); kills everything left after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c is None for c in self.poll()):
            time.sleep(0.1)
        if any(c is None for c in self.poll()):
            self.kill()
            raise AssertionError(f"job did not finish within {timeout} s:\n{self.tail()}")
        return self.poll()

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if any(c is not None for c in self.poll()):
                raise AssertionError(f"a rank exited while waiting for {what}:\n{self.tail()}")
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"timed out waiting for {what}:\n{self.tail()}")

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a SIGSTOPped process
                p.wait()

    def text(self, rank: int) -> str:
        with open(self.logs[rank], encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def tail(self, n: int = 3000) -> str:
        return "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{self.text(r)[-n:]}" for r, p in enumerate(self.procs))


def launch(output_dir: str, overrides=(), nproc: int = 2, fault: str | None = None, log_name: str = "job") -> Job:
    """Start ``nproc`` ranks of launch/train.py with the FAST test config plus ``overrides``."""
    port = free_port()
    os.makedirs(output_dir, exist_ok=True)
    log_dir = os.path.join(os.path.dirname(output_dir.rstrip("/")), "logs")
    os.makedirs(log_dir, exist_ok=True)
    args = merged([f"trainer.output_dir={output_dir}"], FAST, ["trainer.export=none"], overrides)
    procs, logs = [], []
    for rank in range(nproc):
        env = base_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.pop("VERL_DS_FAULT", None)
        if fault:
            env["VERL_DS_FAULT"] = fault
        path = os.path.join(log_dir, f"{log_name}.rank{rank}.log")
        fh = open(path, "w", encoding="utf-8")
        procs.append(subprocess.Popen([sys.executable, TRAIN, *args], cwd=ROOT, env=env, stdout=fh,
                                      stderr=subprocess.STDOUT))
        fh.close()
        logs.append(path)
    return Job(procs, logs, output_dir)


def metric_steps(output_dir: str) -> list[int]:
    """Steps logged in metrics.jsonl that ran a PPO step (step 0 is the initial validation)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r["step"] for r in rows if "training/global_step" in r]


SIGNALS = {signal.SIGKILL: "SIGKILL", signal.SIGTERM: "SIGTERM"}
