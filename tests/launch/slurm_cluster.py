"""A real single-node Slurm for the tests (slurm/local_cluster.sh: munged, slurmctld and slurmd started as
root, config and state in a temporary directory, its own ports and munge socket), and helpers to submit
jobs and wait for events (job state through `scontrol show job`, files) rather than for fixed times.

Use: ``from slurm_cluster import slurm, slurm_cluster  # noqa: F401`` in a test module; ``slurm`` gives a
``SlurmCluster`` and cancels the test's unfinished jobs afterwards. Skips (one line) when the Slurm
packages are missing or the tests do not run as root; `.ci/run` installs the packages."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from launch_testutil import ROOT, base_env, free_port
from verl_ds.report import score_of

LOCAL_CLUSTER = os.path.join(ROOT, "slurm", "local_cluster.sh")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol", "sinfo", "squeue")
# job states after which nothing more happens to the job (a requeued job goes through PENDING instead)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}
POLL_S = 0.5  # how often a wait looks again; a wait ends on its event, its timeout is only a failure guard


def why_no_slurm() -> str | None:
    """Why the real-Slurm tests cannot run here (None when they can)."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"local Slurm not installed (missing {', '.join(missing)}): apt-get install slurmctld slurmd "
                f"slurm-client munge (.ci/run does)")
    if os.geteuid() != 0:
        return "local Slurm needs root (munged, slurmctld and slurmd run as SlurmUser=root)"
    return None


class SlurmCluster:
    """A running local Slurm: its config file, client environment, job submission and waits."""

    def __init__(self, directory: str):
        self.dir = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.jobs: list[int] = []

    def env(self, **extra) -> dict:
        """The test environment plus SLURM_CONF (every client command and every job step needs it)."""
        return base_env(SLURM_CONF=self.conf, **extra)

    def cmd(self, *args: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, script: str, overrides=(), options=(), **env) -> int:
        """Submit ``script`` (relative to the checkout, submitted from it) with sbatch ``options``, the
        environment ``env`` (CONFIG, OUTPUT_DIR, ...) and the config ``overrides``; the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *options, script, *overrides], cwd=ROOT,
                              env=self.env(**env), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"sbatch {script} failed (exit {proc.returncode}): {proc.stderr}"
        job = int(proc.stdout.strip().split(";")[0])
        self.jobs.append(job)
        return job

    def job(self, job: int) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.cmd("scontrol", "show", "job", "--oneliner", str(job)).stdout.strip()
        return dict(re.findall(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)", out))

    def wait(self, what: str, check, job: int, timeout: float, log: str | None = None):
        """Poll ``check()`` until it returns something true, and return that. Fails when ``job`` reaches a
        final state without it (the event will not come any more) or, only as a guard against a hang, after
        ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            rec = self.job(job)
            if rec.get("JobState") in FINAL_STATES:
                value = check()  # the event may have come just before the job ended
                if value:
                    return value
                raise AssertionError(f"job {job} ended {rec.get('JobState')} (exit {rec.get('ExitCode')}, restarts "
                                     f"{rec.get('Restarts')}) before {what}{self.tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout:.0f} s (job {job}: {rec.get('JobState')}, reason "
                                     f"{rec.get('Reason')}){self.tail(log)}")
            time.sleep(POLL_S)

    def wait_state(self, job: int, states: set, timeout: float, log: str | None = None, **fields) -> dict:
        """Wait until the job is in one of ``states`` with these field values (e.g. Restarts=1); its record."""
        def check():
            rec = self.job(job)
            return rec if rec.get("JobState") in states and all(rec.get(k) == str(v) for k, v in fields.items()) \
                else None

        return self.wait(f"state {'/'.join(sorted(states))} {fields}", check, job, timeout, log)

    def wait_end(self, job: int, timeout: float, log: str | None = None) -> dict:
        """Wait for the job's final state; its record."""
        return self.wait_state(job, FINAL_STATES, timeout, log)

    def tail(self, log: str | None, n: int = 6000) -> str:
        """The end of a job's output file and of the daemons' logs, for failure messages."""
        parts = []
        for path in [log, os.path.join(self.dir, "log", "slurmctld.log"), os.path.join(self.dir, "log", "slurmd.log")]:
            if path and os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    parts.append(f"\n--- {path} ---\n{fh.read()[-n:]}")
        return "".join(parts)

    def cancel_leftovers(self) -> None:
        """Cancel this test's jobs that have not ended, and wait until they have left the node."""
        for job in self.jobs:
            if self.job(job).get("JobState") not in FINAL_STATES:
                self.cmd("scancel", "--full", str(job), check=False)
        for job in self.jobs:
            self.wait_end(job, timeout=300)
        self.jobs.clear()


def metric_rows(output_dir: str) -> list[dict]:
    """The rows of ``<output_dir>/metrics.jsonl`` written so far (a partly written last line is left out)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.endswith("\n"):
                rows.append(json.loads(line))
    return rows


def train_steps(output_dir: str) -> list[int]:
    """The steps of the training rows of metrics.jsonl, in file order."""
    return [r["step"] for r in metric_rows(output_dir) if score_of(r) is not None]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A local single-node Slurm for the session, torn down (jobs cancelled, daemons stopped, state
    removed) at the end."""
    reason = why_no_slurm()
    if reason:
        pytest.skip(reason)
    directory = str(tmp_path_factory.mktemp("slurm"))
    env = base_env(SLURMCTLD_PORT=str(free_port()), SLURMD_PORT=str(free_port()))
    up = subprocess.run([LOCAL_CLUSTER, "up", directory], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
    try:
        assert up.returncode == 0, f"slurm/local_cluster.sh up failed (exit {up.returncode}):\n{up.stderr}"
        yield SlurmCluster(directory)
    finally:
        down = subprocess.run([LOCAL_CLUSTER, "down", directory], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert down.returncode == 0, f"slurm/local_cluster.sh down failed: {down.stderr}"


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster; this test's unfinished jobs are cancelled when it ends (pass or fail)."""
    yield slurm_cluster
    slurm_cluster.cancel_leftovers()
