"""Run untrusted Python code (a model's tool call or answer) in a child process with limits.

Each layer applies where the OS allows it; ``SandboxResult.isolation`` names the ones that held:

- resource limits: CPU seconds, address space, file size, open files, no core dumps, processes
  (``RLIMIT_NPROC``, which does not bind root);
- a private temporary directory as working directory, HOME and TMPDIR, removed afterwards, and an
  environment with nothing of the trainer's (no tokens, no paths);
- no writes outside that directory and no signals to processes outside the sandbox: Landlock (Linux 5.13+,
  https://docs.kernel.org/userspace-api/landlock.html; signal scoping from ABI 6);
- no network: a network namespace of its own where the process may create one (root), else Landlock's TCP rules
  (ABI 4);
- an audit hook (PEP 578) in the child that refuses process creation, sockets, ctypes and file writes outside
  the directory: a second layer, and the only one where the kernel offers none (PEP 578 is not a sandbox alone);
- a wall-clock timeout and an output cap, enforced by the parent, which kills the child's whole process group.

An infinite loop, a memory bomb, a fork bomb, a write outside the directory or a flood of output each end as a
``SandboxResult`` with a status; nothing raises into the caller.
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "STATUSES"]

STATUSES = ("ok", "error", "refused", "memory", "cpu_time", "timeout", "output_limit")


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``max_output_bytes`` caps stdout and stderr together."""
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 16
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "max_file_bytes", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended: ``status`` is one of STATUSES; output is cut at the limit (``truncated``)."""
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    truncated: bool
    isolation: tuple

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self, max_chars: int = 2000) -> str:
        """One text for a tool message: the output, or the status and the error's last lines."""
        if self.ok:
            return self.stdout[-max_chars:]
        tail = "\n".join(self.stderr.strip().splitlines()[-5:])
        return f"[{self.status}] {tail}"[-max_chars:]


# The child: applies the limits to itself, then runs main.py. Kept standalone (stdlib only): it runs under -I.
_CHILD = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
work = cfg["dir"]
held = []
def limit(kind, value, hard=None):
    try:
        resource.setrlimit(kind, (value, value if hard is None else hard))
    except (ValueError, OSError):
        return False
    return True
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1) and held.append("cpu")
limit(resource.RLIMIT_AS, cfg["memory_bytes"]) and held.append("memory")
limit(resource.RLIMIT_FSIZE, cfg["file_bytes"]) and held.append("file_size")
limit(resource.RLIMIT_NOFILE, cfg["open_files"])
if os.geteuid() != 0 and limit(resource.RLIMIT_NPROC, cfg["nproc"]):
    held.append("nproc")
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET: a namespace whose only interface, loopback, is down
    held.append("netns")
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: the ABI version
if abi >= 1:
    writes = (1 << 1) | sum(1 << b for b in range(4, 13))  # WRITE_FILE, REMOVE_*, MAKE_*
    writes |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # REFER, TRUNCATE
    net = 3 if abi >= 4 and "netns" not in held else 0  # BIND_TCP | CONNECT_TCP, with no rule allowing any
    scoped = 3 if abi >= 6 else 0  # abstract unix sockets and signals stay inside the sandbox
    attr = (ctypes.c_uint64 * 3)(writes, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
    ok = fd >= 0
    for path, access in ((work, writes), ("/dev/null", (1 << 1) | (1 << 14 if abi >= 3 else 0))):
        pfd = os.open(path, os.O_PATH)
        rule = Beneath(access, pfd)
        ok = ok and libc.syscall(445, fd, ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)) == 0
        os.close(pfd)
    ok = ok and libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    ok = ok and libc.syscall(446, fd, ctypes.c_uint32(0)) == 0
    if ok:
        held += ["landlock_fs"] + (["landlock_tcp"] if net else []) + (["landlock_signals"] if scoped else [])
del libc
for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
    del sys.modules[name]  # a later import is an import again, which the hook refuses
os.write(cfg["report_fd"], json.dumps(held).encode())
os.close(cfg["report_fd"])

class SandboxRefused(PermissionError):
    pass

def inside(path):
    if isinstance(path, int):
        return True  # an fd already open: opened under these rules
    path = os.path.realpath(os.fsdecode(path))
    return path == "/dev/null" or path == work or path.startswith(work + os.sep)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REFUSED = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
           "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "ctypes.dlopen", "ctypes.dlsym",
           "ctypes.call_function", "ctypes.cdata", "os.setuid", "os.chroot", "resource.setrlimit", "resource.prlimit"}
PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
               "os.rename", "os.link", "os.symlink", "shutil.rmtree", "os.mkfifo", "os.mknod"}
if cfg["max_procs"] > 1:
    REFUSED -= {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "subprocess.Popen"}

def hook(event, args):
    if event in REFUSED:
        raise SandboxRefused(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in ("ctypes", "_ctypes", "cffi"):
        raise SandboxRefused(f"sandbox: import {args[0]} is not allowed")
    if event == "open" and args[0] is not None:
        mode, flags = args[1] or "", args[2] or 0
        if (any(c in mode for c in "wax+") or flags & WRITE_FLAGS) and not inside(args[0]):
            raise SandboxRefused(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
    elif event in PATH_EVENTS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        if not all(inside(p) for p in paths):
            raise SandboxRefused(f"sandbox: {event} outside the sandbox directory is not allowed")

sys.addaudithook(hook)
sys.argv = ["main.py"]
import runpy
runpy.run_path(os.path.join(work, "main.py"), run_name="__main__")
'''


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "", max_procs: int = 1) -> SandboxResult:
    """Run ``code`` with ``limits`` in a fresh sandbox; ``max_procs > 1`` lets it start processes (bounded by
    RLIMIT_NPROC where that binds). Never raises for what the code does."""
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    if len(stdin.encode()) > 1 << 16:  # written before reading: more than a pipe holds could block both sides
        raise ValueError(f"run_python: stdin holds at most 65536 bytes, got {len(stdin.encode())}")
    if isinstance(max_procs, bool) or not isinstance(max_procs, int) or max_procs < 1:
        raise ValueError(f"run_python: max_procs must be an int >= 1, got {max_procs!r}")
    limits = limits or SandboxLimits()
    work = os.path.realpath(tempfile.mkdtemp(prefix="verl_ds_sandbox_"))
    report_r, report_w = os.pipe()
    start = time.monotonic()
    try:
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        cfg = {"dir": work, "cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_mb) << 20,
               "file_bytes": int(limits.max_file_bytes), "open_files": int(limits.max_open_files),
               "nproc": _tasks_of_user() + max_procs, "max_procs": max_procs, "report_fd": report_w}
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, json.dumps(cfg)], cwd=work, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(report_w,))
        os.close(report_w)
        report_w = -1
        status, out, err, truncated = _collect(proc, stdin.encode(), limits)
        with os.fdopen(report_r, "rb") as r:
            report_r = -1
            isolation = tuple(json.loads(r.read() or b"[]"))
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if status is None:
        status = _status(proc.returncode, stderr)
    return SandboxResult(status, proc.returncode, stdout, stderr, time.monotonic() - start, truncated, isolation)


def _collect(proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits):
    """Read both pipes until the child ends, the deadline passes or the output passes the cap; the whole
    process group is killed in the last two cases (and in any case at the end: no straggler survives)."""
    deadline = time.monotonic() + limits.timeout_s
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    status, truncated = None, False
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    with selectors.DefaultSelector() as sel:
        for pipe in bufs:
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += chunk
            if sum(map(len, bufs.values())) > limits.max_output_bytes:
                status, truncated = "output_limit", True
                break
    _kill_group(proc)
    for pipe in bufs:
        pipe.close()
    cap = limits.max_output_bytes
    out, err = bytes(bufs[proc.stdout][:cap]), bytes(bufs[proc.stderr][:cap])
    return status, out, err, truncated


def _tasks_of_user() -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) that this user runs now; 0 for root, which the
    limit does not bind."""
    uid = os.geteuid()
    if uid == 0:
        return 0
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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _status(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    last = stderr.strip().splitlines()[-1:] or [""]
    if last[0].startswith(("MemoryError", "SandboxRefused")):
        return "memory" if last[0].startswith("MemoryError") else "refused"
    return "error"
