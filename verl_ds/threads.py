"""The package's one thread pool, for calls that may never return (an environment step, a control-server view)."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

__all__ = ["DaemonPool"]


class DaemonPool:
    """Daemon workers: Python cannot stop a thread, and a ThreadPoolExecutor joins its workers at exit, so one stuck
    call would hang the interpreter's exit; these are left behind instead."""

    def __init__(self, workers: int, name: str):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancels the work not started yet; never waits for the running calls."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[0].cancel()
        for _ in range(self._workers):
            self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller's to judge, as in a ThreadPoolExecutor
                future.set_exception(e)
