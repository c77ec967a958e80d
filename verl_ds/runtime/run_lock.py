"""One job per run directory: rank 0 holds an exclusive ``flock`` on ``<output_dir>/run.lock`` while the job lives,
so a second job is refused, naming the holder, instead of mixing checkpoints and metrics. The kernel drops the lock
however the process ends, so a dead job's file is simply taken over. Details (NFS): docs/reliability.md."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from typing import Optional

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunDirectoryBusy(RuntimeError):
    """Another live job holds the run directory; the message names it."""


class RunLock:
    """The exclusive lock on one run directory; ``release()`` (or the process ending) gives it up."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise RunDirectoryBusy naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if not isinstance(exc, BlockingIOError):  # a file system without locks: say so, do not stop the job
                os.close(fd)
                log.warning("cannot lock %s (%s): a second job on this run directory would not be detected",
                            self.path, exc.strerror)
                return self
            holder = _describe(_read(fd))
            os.close(fd)
            raise RunDirectoryBusy(
                f"trainer.output_dir: {os.path.dirname(self.path)} is in use by another job ({holder}; lock "
                f"{self.path}). Two jobs in one run directory would resume each other's checkpoints and mix their "
                f"logs: wait for that job to end, stop it, or give this one another trainer.output_dir") from None
        previous = _read(fd)
        if previous:  # its process is gone (the kernel released its lock): say whose directory this was
            log.info("run directory %s: taking over the lock left by %s (that job has ended)",
                     os.path.dirname(self.path), _describe(previous))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a finished job leaves no holder to name
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode("utf-8", "replace")) if data.strip() else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info:
        return "a process that has not written its name yet"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"


def lock_run_dir(output_dir: str) -> Optional[RunLock]:
    """Collective: rank 0 locks ``output_dir`` (its lock returned, None elsewhere); RunDirectoryBusy on every rank."""
    from verl_ds import dist as vdist

    lock, busy = None, None
    if vdist.rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        try:
            lock = RunLock(output_dir).acquire()
        except RunDirectoryBusy as exc:
            busy = str(exc)
    busy = vdist.broadcast_object(busy)
    if busy is not None:
        raise RunDirectoryBusy(busy)
    return lock
