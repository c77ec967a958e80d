"""verl_ds.threads.DaemonPool: results and exceptions come back, shutdown cancels queued work, and a call that never
returns does not hold up the interpreter's exit."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

import verl_ds
from verl_ds.threads import DaemonPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(verl_ds.__file__)))


def test_results_and_exceptions_come_back():
    pool = DaemonPool(2, "test-pool")
    try:
        assert pool.submit(pow, 2, 10).result(timeout=10) == 1024
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(timeout=10)
        with pytest.raises(SystemExit):  # delivered as raised: the caller decides what it means
            pool.submit(sys.exit, 3).result(timeout=10)
        assert pool.submit(lambda: threading.current_thread().name).result(timeout=10).startswith("test-pool-")
    finally:
        pool.shutdown()


def test_an_event_loop_awaits_the_future():
    pool = DaemonPool(1, "test-pool")

    async def call():
        return await asyncio.wrap_future(pool.submit(str.upper, "view"))
    try:
        assert asyncio.run(call()) == "VIEW"
    finally:
        pool.shutdown()


def test_shutdown_cancels_queued_work_and_lets_running_work_finish():
    pool = DaemonPool(1, "test-pool")
    started, release, ran = threading.Event(), threading.Event(), []
    running = pool.submit(lambda: started.set() or release.wait(10) and "finished")
    queued = [pool.submit(ran.append, i) for i in range(3)]
    assert started.wait(10)
    pool.shutdown()
    assert all(f.cancelled() for f in queued)
    release.set()
    assert running.result(timeout=10) == "finished"
    time.sleep(0.1)
    assert ran == []


def test_a_call_that_never_returns_does_not_block_exit():
    code = ("import threading\nfrom verl_ds.threads import DaemonPool\n"
            "pool = DaemonPool(2, 'stuck')\nfuture = pool.submit(threading.Event().wait)\n"
            "assert not future.done()\nprint('submitted', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "submitted\n"
    assert time.monotonic() - start < 30
