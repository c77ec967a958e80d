"""Helpers for end-to-end tests: run launch/train.py in subprocesses (1 or 2 ranks) with a timeout."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")

# a short, fast job: tiny model, small batches; tests add their own overrides
FAST = ["trainer.total_steps=2", "rollout.batch_size=8", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
        "rollout.max_new_tokens=6", "data.num_train_prompts=64", "data.num_val_prompts=8",
        "trainer.loggers=[]", "model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64"]


def merged(*groups) -> list:
    """``key=value`` overrides from ``groups``, a later group's key replacing an earlier one's in place (verl-ds
    refuses a key given twice on its command line, or a mapping and a key inside it: ``model.config_overrides={...}``
    replaces an earlier ``model.config_overrides.hidden_size=...`` and the other way round). A ``model.path`` drops
    the built model's ``model.config_overrides*`` (verl-ds refuses them with a model directory)."""
    out: dict = {}
    for group in groups:
        for item in group:
            key = item.split("=", 1)[0]
            out = {k: v for k, v in out.items() if k != key and not k.startswith(key + ".")
                   and not key.startswith(k + ".")}
            out[key] = item
    if "model.path" in out:
        out = {k: v for k, v in out.items() if not k.startswith("model.config_overrides")}
    return list(out.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra) -> dict:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET"):
        env.pop(k, None)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning",
                "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_ext")),
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_train(output_dir: str, overrides=(), nproc: int = 1, timeout: int = 240, env=None, check: bool = True):
    """Run the trainer (``nproc`` ranks via torchrun when > 1); returns the CompletedProcess."""
    args = merged([f"trainer.output_dir={output_dir}"], FAST, overrides)
    if nproc == 1:
        cmd = [sys.executable, TRAIN, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", TRAIN, *args]
    proc = run_group(cmd, env=env or base_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (exit {proc.returncode}):\n--- stdout ---\n{proc.stdout[-4000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_group(cmd: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole process group (torchrun's ranks included, which
    would otherwise live on) and raise TimeoutExpired with what it printed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def wait_until(proc, predicate, what: str, log: str, timeout: float = 600.0):
    """``predicate()``'s first truthy value, polled while the background run ``proc`` (its output in ``log``) lives;
    AssertionError with the log's tail when the run ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}:\n{open(log).read()[-6000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{open(log).read()[-6000:]}")
