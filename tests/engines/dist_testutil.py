"""Run a worker script on N real ranks (gloo, subprocesses) and collect each rank's JSON result.

A plain module, not a conftest: folders' conftest names clash. Workers get the launch variables,
``DS_ACCELERATOR=cpu`` and one thread each; they write ``json.dump(result, open(sys.argv[1] % rank))``.
"""
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EXIT_ABORT = "terminate called without an active exception"

# Appended to every worker: a rank that reaches the end of its script ends like a finished verl_ds run (a barrier,
# the group destroyed, streams flushed, ``os._exit``), not in the interpreter's C++ thread teardown, which now and
# then aborted a rank (``EXIT_ABORT``) after its result was written (``verl_ds.dist.exit_after_shutdown``).
WORKER_END = """

import gc as _gc, logging as _logging, os as _os, sys as _sys
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
_gc.collect()  # closes result files opened inline in a reference cycle
_logging.shutdown()
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""


def run_ranks(script: str, world: int, tmp_path, args=(), timeout: int = 600, env_extra=None,
              end: bool = True) -> list:
    """Write ``script`` to a file, start ``world`` ranks on it, wait, return the ranks' results (list of dicts).

    argv: [result pattern with %d for the rank, *args]. A failing rank fails the test with every rank's output.
    A rank that reaches the end of the script ends through ``WORKER_END`` (``end=False``: through the interpreter's
    own exit, for a test of that exit). One launch is retried once, and only when every rank wrote its result and a
    rank then aborted in the C++ thread teardown at interpreter exit (``EXIT_ABORT``, SIGABRT: a worker that ends
    with ``sys.exit`` still can); the retried launch's results are the ones checked.
    """
    try:
        return _run_ranks(script + WORKER_END * end, world, tmp_path, args, timeout, env_extra)
    except _AbortedAtExit as exc:
        print(f"run_ranks: retrying once: {exc}", file=sys.stderr)
        return _run_ranks(script + WORKER_END * end, world, tmp_path, args, timeout, env_extra, retry=False)


class _AbortedAtExit(AssertionError):
    pass


def _run_ranks(script, world, tmp_path, args, timeout, env_extra, retry=True) -> list:
    path = os.path.join(str(tmp_path), f"worker_{abs(hash(script)) % 10**8}.py")
    with open(path, "w") as fh:
        fh.write(script)
    pattern = os.path.join(str(tmp_path), f"result_w{world}_%d.json")
    port = str(free_port())
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]),
               "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_ext")),
               **(env_extra or {})}
        env.pop("TRITON_INTERPRET", None)
        log = open(os.path.join(str(tmp_path), f"rank{rank}_w{world}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, path, pattern, *map(str, args)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    failed = []
    try:
        for rank, proc in enumerate(procs):
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
                for p in procs:
                    p.kill()
            if rc != 0:
                failed.append((rank, rc))
    finally:  # interrupted (pytest-timeout, Ctrl-C): never leave ranks behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    at_exit = all(rc == -6 and outputs[r].rstrip().endswith(EXIT_ABORT) for r, rc in failed)
    if failed and retry and at_exit and all(os.path.isfile(pattern % r) for r in range(world)):
        for r in range(world):
            os.remove(pattern % r)
        raise _AbortedAtExit(f"ranks {failed} aborted at exit after writing their results")
    if failed:
        raise AssertionError(f"ranks failed {failed}:\n"
                             + "\n".join(f"--- rank {r}\n{o[-6000:]}" for r, o in enumerate(outputs)))
    results = []
    for rank in range(world):
        with open(pattern % rank) as fh:
            results.append(json.load(fh))
    return results
