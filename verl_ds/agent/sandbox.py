"""Run untrusted Python (a model's tool call or answer) in a sandbox with limits; docs/agents.md, "The sandbox".
``bwrap``: bubblewrap's namespaces (no host files but /usr and the runtime, no host processes, no network, a capped
tmpfs). ``weak``: Landlock and a netns where the kernel allows, only if ``agent.allow_weak_sandbox``. Both add
rlimits, an audit hook, the parent's timeout and output cap; the status comes from the harness, never the output."""
from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from verl_ds.agent import bwrap as _bw

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python", "require_sandbox",
           "sandbox_in_force", "call_counts", "STATUSES", "INSTALL_HINT"]

STATUSES = ("ok", "error", "refused", "memory", "cpu_time", "timeout", "output_limit", "disk_limit")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
with open(os.path.join(os.path.dirname(__file__), "sandbox_runner.py")) as _f:
    _RUNNER = _f.read()  # passed with -c: nothing of the package needs to be readable inside the sandbox
_ROOT_NOTE = (" (RLIMIT_NPROC does not bind uid 0: processes are stopped by the seccomp filter at max_procs=1 "
              "only)")
_STATE = {"probe": None, "weak_ok": False}
_LOCK = threading.Lock()
_CALLS: Counter = Counter()


class SandboxUnavailable(RuntimeError):
    """No sandbox that holds (bubblewrap missing or unable to make namespaces) and the weak one not accepted."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``max_output_bytes`` caps stdout and stderr together; ``disk_mb`` and ``max_files`` the work
    directory (bwrap only: the weak backend bounds only ``max_file_bytes`` per file)."""
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 16
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    disk_mb: int = 64
    max_files: int = 10000

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "max_file_bytes", "max_open_files",
                     "disk_mb", "max_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended; ``tests_passed`` (with ``tests``): whether the harness saw the last test statement finish."""
    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    seconds: float
    truncated: bool
    isolation: tuple
    tests_passed: Optional[bool] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self, max_chars: int = 2000) -> str:
        """One text for a tool message: the output, or the status and the error's last lines."""
        if self.ok:
            return self.stdout[-max_chars:]
        tail = "\n".join(self.stderr.strip().splitlines()[-5:])
        return f"[{self.status}] {tail}"[-max_chars:]


def _probe() -> tuple[bool, str]:
    """Whether bubblewrap runs a sandbox here, and the isolation line (or what is missing); cached."""
    with _LOCK:
        if _STATE["probe"] is None:
            path = _bw.find_bwrap()
            if path is None:
                _STATE["probe"] = (False, f"bubblewrap (bwrap) is not on PATH ({os.environ.get('PATH', '')!r})")
            else:
                try:
                    r = _run("print('ok')", SandboxLimits(timeout_s=30), "", 1, None, "bwrap")
                    ok = r.ok and r.stdout == "ok\n"
                    why = "" if ok else f"{path} cannot make a sandbox here: {r.stderr.strip()[-300:] or r.status}"
                except OSError as exc:
                    ok, why = False, f"{path} cannot be run: {exc}"
                uid = _bw.host_uid()
                _STATE["probe"] = (ok, f"bubblewrap namespaces (user, pid, mount, net, ipc, uts) via {path}, host "
                                       f"uid {uid}{'' if uid else _ROOT_NOTE}" if ok else why)
        return _STATE["probe"]


def require_sandbox(allow_weak: bool) -> str:
    """At start-up: the isolation line to log, or SandboxUnavailable naming what is missing (unless ``allow_weak``)."""
    ok, line = _probe()
    if ok:
        return line
    if not allow_weak:
        raise SandboxUnavailable(f"model-written code would run without a sandbox that holds: {line}; "
                                 f"{INSTALL_HINT}, or set agent.allow_weak_sandbox=true to accept the weak one")
    _STATE["weak_ok"] = True
    return (f"WEAK sandbox (rlimits, Landlock where the kernel has it, an audit hook the code can remove; the "
            f"trainer's files and processes are reachable): {line}; accepted by agent.allow_weak_sandbox")


def sandbox_in_force() -> str:
    """``bwrap``, ``weak`` (accepted) or ``none`` (run_python would raise)."""
    return "bwrap" if _probe()[0] else "weak" if _STATE["weak_ok"] else "none"


def call_counts() -> dict:
    """Sandbox runs in this process so far, per backend (the agent rollout's metrics)."""
    with _LOCK:
        return dict(_CALLS)


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "", max_procs: int = 1, *,
               tests: str | None = None, backend: str | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandbox, then ``tests`` in its namespace; never raises for what the code does.
    ``backend`` None: bwrap, else the accepted weak one, else SandboxUnavailable. ``max_procs > 1`` allows processes."""
    if not isinstance(code, str) or not isinstance(tests, (str, type(None))):
        raise TypeError(f"run_python: code must be a str and tests a str or None, got {type(code).__name__}, "
                        f"{type(tests).__name__}")
    if len(stdin.encode()) > 1 << 16:  # written before reading: more than a pipe holds could block both sides
        raise ValueError(f"run_python: stdin holds at most 65536 bytes, got {len(stdin.encode())}")
    if isinstance(max_procs, bool) or not isinstance(max_procs, int) or max_procs < 1:
        raise ValueError(f"run_python: max_procs must be an int >= 1, got {max_procs!r}")
    if backend not in (None, "bwrap", "weak"):
        raise ValueError(f"run_python: backend must be None, 'bwrap' or 'weak', got {backend!r}")
    if backend is None:
        backend = sandbox_in_force()
        if backend == "none":
            raise SandboxUnavailable(f"{_probe()[1]}; {INSTALL_HINT}, or accept the weak sandbox "
                                     "(agent.allow_weak_sandbox=true)")
    with _LOCK:
        _CALLS[backend] += 1
    return _run(code, limits or SandboxLimits(), stdin, max_procs, tests, backend)


def _run(code, limits, stdin, max_procs, tests, backend) -> SandboxResult:
    nonce = secrets.token_hex(16)
    weak = backend == "weak"
    uid = os.geteuid() if weak else _bw.host_uid()
    work = os.path.realpath(tempfile.mkdtemp(prefix="verl_ds_sandbox_")) if weak else _bw.WORK
    job = {"dir": work, "cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_mb) << 20,
           "file_bytes": int(limits.max_file_bytes), "open_files": int(limits.max_open_files),
           # RLIMIT_NPROC counts the uid's processes; in bwrap's user namespace (Linux 5.14+) only the sandbox's
           # own: the runner and its children (+1 in case the namespace's init counts too)
           "nproc": 0 if uid == 0 else (_tasks_of_user(uid) + max_procs if weak else max_procs + 1),
           "max_procs": max_procs, "weak": weak, "code": code, "tests": tests, "nonce": nonce}
    job_fd = _memfd(json.dumps(job).encode())  # never blocks, whatever the code's size; the runner closes it
    seccomp = _bw.no_process_filter() if not weak and max_procs == 1 else None
    seccomp_fd = _memfd(seccomp) if seccomp else -1
    result_r, result_w = os.pipe()
    start = time.monotonic()
    try:
        args = ["-c", _RUNNER, str(job_fd), str(result_w)]
        if weak:
            cmd, env, extra = [sys.executable, "-I", *args], {
                "PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8"}, {}
        else:
            cmd = _bw.bwrap_command(_bw.find_bwrap() or "bwrap", int(limits.disk_mb) << 20,
                                    seccomp_fd if seccomp else None) + args
            env, extra = {}, {"user": uid, "group": uid, "extra_groups": []} if uid != os.geteuid() else {}
        proc = subprocess.Popen(cmd, cwd=work if weak else "/", env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                pass_fds=tuple(fd for fd in (job_fd, result_w, seccomp_fd) if fd >= 0), **extra)
        for fd in (result_w, job_fd, seccomp_fd):
            if fd >= 0:
                os.close(fd)
        result_w = job_fd = seccomp_fd = -1
        status, out, err, truncated, lines, inodes = _collect(proc, stdin.encode(), result_r, limits, not weak)
    finally:
        for fd in (job_fd, result_r, result_w, seccomp_fd):
            if fd >= 0:
                os.close(fd)
        if weak:
            shutil.rmtree(work, ignore_errors=True)
    signed = [ln.split(" ", 2)[1:] for ln in lines.decode("utf-8", "replace").splitlines()
              if ln.startswith(nonce + " ")]
    events = {s[0]: (s[1] if len(s) > 1 else "") for s in signed}
    isolation = tuple(json.loads(events.get("start") or "[]"))
    if not weak and "start" in events:
        isolation = (("namespaces", f"host_uid_{uid}", "disk") + ("no_processes",) * bool(seccomp)
                     + ("inodes",) * inodes + isolation)
    if status is None:
        status = _status(proc.returncode, events)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    return SandboxResult(status, proc.returncode, stdout, stderr, time.monotonic() - start, truncated, isolation,
                         None if tests is None else "passed" in events)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("sandbox", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _inodes_used(bwrap_pid: int, disk_bytes: int) -> int | None:
    """Entries in the sandbox's work directory, via its first process's root (bwrap 0.8 cannot cap a tmpfs's inodes);
    None until that root is the tmpfs of ``disk_bytes`` (before the pivot it is the host's, whose /work may exist)."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            child = f.read().split()[0]
        st = os.statvfs(f"/proc/{child}/root{_bw.WORK}")
    except (OSError, IndexError):
        return None
    if abs(st.f_blocks * st.f_frsize - disk_bytes) >= max(st.f_frsize, 1 << 12):
        return None
    return st.f_files - st.f_ffree


def _collect(proc: subprocess.Popen, stdin: bytes, result_fd: int, limits: SandboxLimits, count_inodes: bool):
    """Read the pipes until the child ends or a limit is hit, then kill its session: no straggler survives."""
    deadline = time.monotonic() + limits.timeout_s
    fo, fe = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {fo: bytearray(), fe: bytearray(), result_fd: bytearray()}
    status, truncated, counted = None, False, False
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.1 if count_inodes else 0.5)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
            if len(bufs[result_fd]) > 1 << 16:  # the harness writes a few lines: more is the code's noise
                del bufs[result_fd][4096:]
            if len(bufs[fo]) + len(bufs[fe]) > limits.max_output_bytes:
                status, truncated = "output_limit", True
                break
            used = _inodes_used(proc.pid, int(limits.disk_mb) << 20) if count_inodes else None
            counted = counted or used is not None
            if used is not None and used > limits.max_files:
                status = "disk_limit"
                break
    waited = None
    while status is None and waited is None:  # the pipes closed: wait for the exit (the code may live on)
        pid, code = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            waited = code
        elif time.monotonic() > deadline:
            status = "timeout"
        else:
            time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    code = waited if waited is not None else os.waitpid(proc.pid, 0)[1]
    proc.returncode = os.waitstatus_to_exitcode(code)
    proc.stdout.close()
    proc.stderr.close()
    cap = limits.max_output_bytes
    return status, bytes(bufs[fo][:cap]), bytes(bufs[fe][:cap]), truncated, bytes(bufs[result_fd]), counted


def _tasks_of_user(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) that ``uid`` runs now."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[1]) == uid:  # real, effective, saved, filesystem
            count += int(fields.get("Threads", "1"))
    return count


def _status(returncode: int, events: dict) -> str:
    """From the harness only: the exit status, the CPU time the kernel counted, the runner's signed lines."""
    for status in ("memory", "refused", "cpu_time"):
        if status in events:
            return status
    if returncode == -signal.SIGXCPU:  # the kernel's signal (weak backend): no exit status looks like it
        return "cpu_time"
    return "ok" if returncode == 0 else "error"
