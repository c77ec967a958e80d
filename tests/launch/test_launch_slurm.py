"""The Slurm scripts without Slurm: syntax, parameters, node-list expansion, the DeepSpeed hostfile, and
the step runner's signal forwarding and requeue on the trainer's preemption exit status (75)."""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from launch_testutil import ROOT, base_env, free_port

pytestmark = pytest.mark.slow  # real training runs / several processes

SLURM = os.path.join(ROOT, "slurm")
SCRIPTS = ["train.sbatch", "train_deepspeed.sbatch", "task.sh", "deepspeed_node.sh", "common.sh"]


def bash(script: str, env=None, timeout=30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env or base_env(PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=timeout, **kw)


def sbatch_options(name: str) -> dict:
    opts = {}
    with open(os.path.join(SLURM, name), encoding="utf-8") as fh:
        for line in fh:
            m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
            if m:
                opts[m.group(1)] = m.group(2)
    return opts


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse(name):
    proc = subprocess.run(["bash", "-n", os.path.join(SLURM, name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_step_scripts_are_executable():
    for name in ("task.sh", "deepspeed_node.sh"):
        assert os.access(os.path.join(SLURM, name), os.X_OK), name


def test_sbatch_parameters():
    srun = sbatch_options("train.sbatch")
    assert srun["ntasks-per-node"] == srun["gpus-per-node"]  # one task per GPU
    ds = sbatch_options("train_deepspeed.sbatch")
    assert ds["ntasks-per-node"] == "1"  # the deepspeed launcher starts the node's ranks
    for opts in (srun, ds):
        assert opts["signal"] == "B:USR1@120" and "requeue" in opts and opts["open-mode"] == "append"
        for key in ("nodes", "gpus-per-node", "partition", "time", "cpus-per-task"):
            assert key in opts, key


NODE_LISTS = ["gpu[01-03,07],cpu5", "localhost", "node[8-11]", "a1,b[001-002,010],c[7]", "x[098-101]"]


def expand_in_shell(env) -> list[list[str]]:
    proc = subprocess.run(["/bin/bash", "-c", ". slurm/common.sh; " + "; echo --; ".join(
        f"vds_hosts '{nl}'" for nl in NODE_LISTS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [chunk.split() for chunk in proc.stdout.split("--")]


def test_shell_nodelist_expansion_equals_the_trainers():
    """The shell's own expansion (no scontrol on PATH) gives the trainer's host names."""
    from verl_ds.dist import expand_nodelist

    env = base_env(PYTHON=sys.executable, PATH=os.path.dirname(sys.executable))
    assert expand_in_shell(env) == [expand_nodelist(nl) for nl in NODE_LISTS]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's scontrol is not installed")
def test_with_scontrol_installed_the_names_are_the_trainers():
    """scontrol expands the list where it has a slurm.conf; where it has none (CI installs slurm-client without
    one; it fails), the shell's expansion is used: the trainer's names either way."""
    from verl_ds.dist import expand_nodelist

    env = base_env(PYTHON=sys.executable)
    env.pop("SLURM_CONF", None)  # a SLURM_CONF naming a missing file makes scontrol retry for 60 s
    assert expand_in_shell(env) == [expand_nodelist(nl) for nl in NODE_LISTS]


def test_nodelist_expansion_and_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    proc = bash(f". slurm/common.sh; vds_hosts 'gpu[01-03,07],cpu5'; vds_write_hostfile {hostfile} 4 'n[8-10]'")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert hostfile.read_text() == "n8 slots=4\nn9 slots=4\nn10 slots=4\n"


def test_no_nodelist_is_a_clear_error():
    proc = bash(". slurm/common.sh; vds_hosts")
    assert proc.returncode == 1 and "SLURM_JOB_NODELIST is not set" in proc.stderr


def test_deepspeed_sbatch_dry_run_builds_the_hostfile_and_the_srun_step(tmp_path):
    env = base_env(PYTHON=sys.executable, SLURM_JOB_NODELIST="gpu[01-02]", SLURM_JOB_ID="4242", GPUS_PER_NODE="4",
                   OUTPUT_DIR=str(tmp_path / "run"), DRY_RUN="1", REPO_DIR=ROOT, VENV=str(tmp_path / "novenv"))
    proc = bash(f"bash slurm/train_deepspeed.sbatch trainer.total_steps=3", env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "hostfile").read_text() == "gpu01 slots=4\ngpu02 slots=4\n"
    assert "master gpu01:24242" in proc.stderr
    assert proc.stdout.splitlines()[-1] == ("srun --kill-on-bad-exit=0 --wait=60 --nodes=2 --ntasks-per-node=1 "
                                            "--cpu-bind=none slurm/deepspeed_node.sh trainer.total_steps=3")


def test_task_script_without_slurm_variables_names_them(tmp_path):
    env = base_env(REPO_DIR=ROOT, CONFIG="configs/default.yaml", OUTPUT_DIR=str(tmp_path))
    env.pop("SLURM_PROCID", None)
    proc = subprocess.run([os.path.join(SLURM, "task.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode != 0 and "SLURM_PROCID is not set" in proc.stderr


# A stand-in trainer: on USR1/TERM it "checkpoints" (writes the signal number) and exits 75, like the real one.
FAKE_TRAINER = r'''
import signal, sys
def stop(sig, frame):
    open(sys.argv[1], "w").write(str(sig)); sys.exit(75)
signal.signal(signal.SIGUSR1, stop); signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".ready", "w").close()
while True:  # until the signal: a slow test must not see this exit on its own
    signal.pause()
'''


def _run_step(tmp_path, send=None, exit_code=None, restarts=0, reason=""):
    marker, requeued = tmp_path / "signal", tmp_path / "requeued"
    if exit_code is None:
        step = f"{sys.executable} -c {shlex.quote(FAKE_TRAINER)} {marker}"
    else:
        step = f"{sys.executable} -c 'import sys; sys.exit({exit_code})'"
    env = base_env(SLURM_JOB_ID="77", SLURM_RESTART_COUNT=str(restarts), MAX_REQUEUES="3",
                   REQUEUE_CMD=f"echo requeue $SLURM_JOB_ID > {requeued}")
    # what scontrol would say of the job (no Slurm here): the Reason once Slurm has ended it
    fake_reason = f"vds_job_reason() {{ echo {shlex.quote(reason)}; }}"
    proc = subprocess.Popen(["bash", "-c", f". slurm/common.sh; {fake_reason}; vds_run_step {step}; echo rc=$?"],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if send is not None:
            # wait for the event (the step's handlers are set), not for a time: a loaded machine is slow
            wait_for_files([tmp_path / "signal.ready"], proc)
            proc.send_signal(send)
        out, err = proc.communicate(timeout=300)  # a guard against a hang only
    finally:
        if proc.poll() is None:
            proc.kill()
    return out, err, marker, requeued


def wait_for_files(paths, proc) -> None:
    """Return once every path exists; fail if ``proc`` ends first (the files will not come)."""
    while not all(os.path.exists(p) for p in paths):
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {[str(p) for p in paths]} existed:\n"
                                 f"{(out or '')[-3000:]}\n{(err or '')[-3000:]}")
        time.sleep(0.05)


@pytest.mark.parametrize("sig,reason", [(signal.SIGUSR1, ""), (signal.SIGTERM, "TimeLimit")])
def test_run_step_forwards_the_signal_and_requeues_on_exit_75(tmp_path, sig, reason):
    """USR1 (the warning before the time limit), or TERM at the time limit itself: checkpoint and requeue."""
    out, err, marker, requeued = _run_step(tmp_path, send=sig, reason=reason)
    assert marker.read_text() == str(int(sig))
    assert out.strip() == "rc=75"
    assert requeued.read_text().strip() == "requeue 77"
    assert "requeueing job 77 (restart 1)" in err


@pytest.mark.parametrize("reason", ["None", ""])
def test_run_step_does_not_requeue_after_a_cancel(tmp_path, reason):
    """TERM from scancel or preemption (Reason None, or scontrol unreachable): the checkpoint is written and
    the job is not brought back (scontrol requeue would revive even a cancelled job)."""
    out, err, marker, requeued = _run_step(tmp_path, send=signal.SIGTERM, reason=reason)
    assert marker.read_text() == str(int(signal.SIGTERM)) and out.strip() == "rc=75"
    assert not requeued.exists()
    assert "after Slurm's TERM (scancel or preemption): not requeueing" in err


@pytest.mark.parametrize("code", [0, 1])
def test_run_step_does_not_requeue_other_exits(tmp_path, code):
    out, err, _, requeued = _run_step(tmp_path, exit_code=code)
    assert out.strip() == f"rc={code}" and not requeued.exists()
    assert ("failed with exit status 1" in err) == (code == 1)


def test_run_step_stops_requeueing_after_max_requeues(tmp_path):
    out, err, _, requeued = _run_step(tmp_path, exit_code=75, restarts=3)
    assert out.strip() == "rc=75" and not requeued.exists()
    assert "already requeued 3 times (MAX_REQUEUES=3)" in err


# A stand-in rank for the deepspeed launcher: records its rank and the signal, exits 75 like the trainer.
FAKE_RANK = r'''
import os, signal, sys

out = os.environ["OUTPUT_DIR_FOR_TEST"]
def stop(sig, frame):
    open(os.path.join(out, f"rank{os.environ['RANK']}.signal"), "w").write(str(sig)); sys.exit(75)
signal.signal(signal.SIGUSR1, stop)
assert any(a.startswith("--local_rank=") for a in sys.argv), sys.argv
open(os.path.join(out, f"rank{os.environ['RANK']}.ready"), "w").close()
while True:  # until the signal: the other rank may start much later on a loaded machine
    signal.pause()
'''


def test_deepspeed_node_passes_usr1_to_the_ranks_and_75_back(tmp_path):
    """slurm/deepspeed_node.sh under a real deepspeed launcher (2 slots): USR1 reaches both ranks (and not the
    launcher's own processes, which USR1 would kill), and the ranks' 75 comes back as the script's status."""
    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = base_env(SLURM_NODEID="0", HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   REPO_DIR=ROOT, CONFIG="unused.yaml", OUTPUT_DIR=str(tmp_path), OUTPUT_DIR_FOR_TEST=str(tmp_path),
                   TRAIN_SCRIPT=str(script), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.Popen([os.path.join(SLURM, "deepspeed_node.sh")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for_files([tmp_path / f"rank{r}.ready" for r in (0, 1)], proc)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=300)  # a guard against a hang only
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, out[-4000:]
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.signal").read_text() == str(int(signal.SIGUSR1))
