"""One job per run directory, and every stop signal a person or a terminal sends ends in a checkpoint and exit 75
(issue 31, items 14 and 15). Real launch/train.py processes; the unit checks use the real lock file and handlers."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, merged
from reliability_testutil import metric_steps
from verl_ds.checkpoint import verify
from verl_ds.runtime import PreemptionHandler

COMMON = ["trainer.export=none", "trainer.val_every=0"]
START_TIMEOUT = 600


def _terminal_signals():
    # as a terminal's foreground job has them (a test runner started in the background may pass SIGINT ignored)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _start(out: str, overrides=(), log_name="job"):
    log = open(os.path.join(os.path.dirname(out), f"{log_name}.log"), "w")
    proc = subprocess.Popen([sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, COMMON, overrides)], cwd=ROOT,
                            env=base_env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_terminal_signals)
    log.close()
    return proc, log.name


def _wait_for_step(proc, out: str, log_path: str, step: int = 1) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while step not in metric_steps(out):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no step {step} (exit {proc.poll()}):\n{open(log_path).read()[-4000:]}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ item 14


def test_the_lock_names_its_holder_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    from verl_ds.runtime.run_lock import RunDirectoryBusy, RunLock

    first = RunLock(str(tmp_path)).acquire()
    holder = json.load(open(tmp_path / "run.lock"))
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RunDirectoryBusy, match=rf"in use by another job \(pid {os.getpid()} on host "
                                               rf"{socket.gethostname()}, started "):
        RunLock(str(tmp_path)).acquire()
    first.release()
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 999999, "host": "gone", "started": "then"}))  # a SIGKILLed job
    import logging

    with caplog.at_level(logging.INFO, logger="verl_ds.runtime.run_lock"):
        second = RunLock(str(tmp_path)).acquire()
    assert "taking over the lock left by pid 999999 on host gone" in caplog.text
    assert json.load(open(tmp_path / "run.lock"))["pid"] == os.getpid()
    second.release()


@pytest.mark.slow
def test_a_second_job_on_the_same_run_directory_is_refused(tmp_path):
    """Job A trains; job B on the same trainer.output_dir exits 2 naming A's pid and host, before writing anything
    (A's config, metrics and checkpoints untouched). A is then SIGKILLed: job C takes its lock over and runs."""
    out = str(tmp_path / "run")
    a, a_log = _start(out, ["trainer.total_steps=100000", "trainer.save_every=0"], "a")
    try:
        _wait_for_step(a, out, a_log)
        config_before = open(os.path.join(out, "config.yaml")).read()
        b = subprocess.run([sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, COMMON, ["trainer.seed=7"])],
                           cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=START_TIMEOUT)
        assert b.returncode == 2, b.stderr[-4000:]
        assert "Traceback" not in b.stderr
        assert (f"verl_ds: error: trainer.output_dir: {out} is in use by another job (pid {a.pid} on host "
                f"{socket.gethostname()}, started ") in b.stderr, b.stderr[-3000:]
        assert a.poll() is None and open(os.path.join(out, "config.yaml")).read() == config_before
        assert "resumed from" not in b.stdout + b.stderr
    finally:
        a.kill()
        a.wait()
    c, c_log = _start(out, ["trainer.total_steps=1", "trainer.resume=none"], "c")
    assert c.wait(timeout=START_TIMEOUT) == 0, open(c_log).read()[-4000:]
    assert f"taking over the lock left by pid {a.pid} on host {socket.gethostname()}" in open(c_log).read()


# ------------------------------------------------------------------------------------------------ item 15


def test_an_ignored_sighup_or_sigint_stays_ignored():
    """nohup (SIGHUP) and a non-interactive shell's background job (SIGINT) promise the job survives those."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGINT)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        handler = PreemptionHandler().install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == handler._on_signal
        handler.uninstall()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_sigint_and_sighup_checkpoint_and_exit_75(tmp_path, sig):
    """Ctrl-C and a hang-up during training: the step in flight finishes, a checkpoint of it is written, the job
    exits 75 with one line naming the signal and the checkpoint, and no traceback (SIGINT used to raise
    KeyboardInterrupt without a checkpoint; SIGHUP killed at once)."""
    out = str(tmp_path / "run")
    proc, log_path = _start(out, ["trainer.total_steps=100000", "trainer.save_every=0"])
    _wait_for_step(proc, out, log_path)
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    log = open(log_path).read()
    assert code == 75, log[-4000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    latest = open(os.path.join(out, "checkpoints", "latest")).read()
    step = int(latest.split("_")[-1])
    step_dir = os.path.join(out, "checkpoints", latest)
    assert step >= 1 and verify(step_dir) is None
    assert metric_steps(out) == list(range(1, step + 1))
    assert f"verl_ds: {sig.name} received: stopped after step {step}, checkpoint {step_dir}; exiting with 75" in log
