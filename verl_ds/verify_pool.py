"""math-verify in worker processes killed past a wall-clock timeout: sympy can hold the GIL for minutes on an answer
like ``\\boxed{9^{9^{9^{9}}}}``, and math-verify's SIGALRM timeout works on the main thread only (its docs ask
threaded callers to time out themselves: https://github.com/huggingface/Math-Verify). Workers are fork+exec'd (the
trainer holding torch and NCCL is never forked). Details: docs/config.md, "Rule-based rewards on model text"."""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding the verl_ds package
_WORKER_CODE = f"import sys; sys.path.insert(0, {_ROOT!r}); from verl_ds.verify_pool import main; main()"
START_TIMEOUT_S = 120.0  # importing sympy on a loaded node: not counted against a check's timeout
_MEMORY_CAP = 4 << 30  # bytes of address space per worker: a hostile answer gets MemoryError, not the node's RAM
_GOLD_CACHE = 4096  # parsed references kept per worker (a prompt's n samples share one)


def main() -> None:
    """A worker: one JSON request per line on stdin ({"gold", "pred" (or null), "cpu_s"}), one JSON reply per line
    ({"gold": parsed?, "correct": bool}) on the original stdout; library prints go to stderr."""
    import logging
    import resource

    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_CAP if hard == resource.RLIM_INFINITY else min(_MEMORY_CAP, hard),
                                            hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker ended by RLIMIT_CPU leaves no core file

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        from math_verify import parse, verify
    except ImportError as e:
        reply({"error": f"importing math_verify failed: {e}"})
        return
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "Timeout is disabled": this process is the timeout
    golds: dict = {}

    def check(gold_text: str, pred_text) -> dict:
        gold = golds.get(gold_text)
        if gold is None:
            # wrapped in \boxed{} the extractor takes the whole reference as one expression
            gold = parse(f"\\boxed{{{gold_text}}}", parsing_timeout=None) or parse(gold_text, parsing_timeout=None)
            if len(golds) >= _GOLD_CACHE:
                golds.clear()
            golds[gold_text] = gold
        if not gold or pred_text is None:
            return {"gold": bool(gold), "correct": False}
        pred = parse(pred_text, parsing_timeout=None)
        return {"gold": True, "correct": bool(pred) and bool(verify(gold, pred, timeout_seconds=None))}

    check("1", "\\boxed{1}")  # sympy's lazy set-up happens here, not inside the first timed check
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        # a backstop if the trainer dies without killing us: the kernel ends a check that runs on and on
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        cpu_soft = int(used + 2 * request["cpu_s"]) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_soft if cpu_hard == resource.RLIM_INFINITY
                                                 else min(cpu_soft, cpu_hard), cpu_hard))
        try:
            reply(check(request["gold"], request["pred"]))
        except MemoryError:  # the address-space cap: the caller sees a dead worker, as after a timeout
            os._exit(3)
        except Exception as e:  # math-verify catches its own errors; this is a bug worth seeing, not a score
            reply({"error": f"{type(e).__name__}: {e}"})


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self._buf = b""
        ready = self.read(START_TIMEOUT_S)
        if ready is None or "error" in ready:
            self.kill()
            why = ready["error"] if ready else f"it did not start within {START_TIMEOUT_S:g} s"
            raise RuntimeError(f"math_verify: a worker process failed to start: {why}")

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        """The reply, or None when there is none within ``timeout_s`` or the worker died."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # BrokenPipeError: the worker is gone
            return None
        return self.read(timeout_s)

    def read(self, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # not select.select: a trainer can hold more than FD_SETSIZE descriptors
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # end of file: the worker died
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a request left unflushed in a dead worker's pipe
                pass


class WorkerPool:
    """Worker processes shared by threads, each ``ask`` with a worker to itself (no lock held across checks)."""

    def __init__(self, max_workers: int | None = None):
        self.max_workers = max_workers or len(os.sched_getaffinity(0))
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._starting = 0
        self._cv = threading.Condition()
        self._pid = os.getpid()  # a forked child must neither use nor kill its parent's workers
        atexit.register(self.close)

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        """The worker's reply, or None past ``timeout_s`` (the worker is killed) or when it died."""
        worker, reply = self._acquire(), None
        try:
            reply = worker.ask({**request, "cpu_s": timeout_s}, timeout_s)
        finally:
            with self._cv:
                if reply is None:
                    self._live.discard(worker)
                else:
                    self._idle.append(worker)
                self._cv.notify()
            if reply is None:
                worker.kill()
        if reply is not None and "error" in reply:
            raise RuntimeError(f"math_verify worker: {reply['error']}")
        return reply

    def _acquire(self) -> _Worker:
        with self._cv:
            if self._pid != os.getpid():
                self._idle, self._live, self._starting, self._pid = [], set(), 0, os.getpid()
            while not self._idle and len(self._live) + self._starting >= self.max_workers:
                self._cv.wait()
            if self._idle:
                return self._idle.pop()
            self._starting += 1
        worker = None
        try:
            worker = _Worker()  # outside the lock: the other threads keep their workers meanwhile
        finally:
            with self._cv:
                self._starting -= 1
                if worker is not None:
                    self._live.add(worker)
                self._cv.notify()
        return worker

    def size(self) -> int:
        """Worker processes alive now."""
        with self._cv:
            return len(self._live)

    def close(self) -> None:
        """Kill every worker (busy ones too: their ``ask`` returns None)."""
        with self._cv:
            if self._pid != os.getpid():
                return
            workers, self._idle = list(self._live), []
            self._live.clear()
        for worker in workers:
            worker.kill()
