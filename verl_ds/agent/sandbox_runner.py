"""The harness inside the sandbox (stdlib only, run as ``python -I -c``): limits, then the code and its tests.

Its job comes on a memfd (argv[1]) closed before the code runs; it reports only lines signed with the job's nonce
on argv[2]'s fd, so printing or exiting early reports nothing. Code that reads this process's memory could still
forge a line: no in-process harness can stop that (docs/agents.md)."""
import json
import os
import resource
import signal
import sys
import traceback

def _limit(kind, value, hard=None):
    try:
        resource.setrlimit(kind, (value, value if hard is None else hard))
    except (ValueError, OSError):
        return False
    return True


def _landlock(work, held):
    """The weak path's Landlock (no writes outside ``work``, no TCP, no signals out from ABI 6;
    https://docs.kernel.org/userspace-api/landlock.html), and a network namespace where the process may make one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET: a namespace whose only interface, loopback, is down
        held.append("netns")
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: the ABI
    if abi < 1:
        return
    writes = (1 << 1) | sum(1 << b for b in range(4, 13))  # WRITE_FILE, REMOVE_*, MAKE_*
    writes |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # REFER, TRUNCATE
    net = 3 if abi >= 4 and "netns" not in held else 0  # BIND_TCP | CONNECT_TCP, with no rule allowing any
    scoped = 3 if abi >= 6 else 0  # abstract unix sockets and signals stay inside the sandbox
    attr = (ctypes.c_uint64 * 3)(writes, net, scoped)
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(24 if abi >= 6 else 16 if abi >= 4 else 8),
                      ctypes.c_uint32(0))

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
    ok = fd >= 0
    for path, access in ((work, writes), ("/dev/null", (1 << 1) | (1 << 14 if abi >= 3 else 0))):
        pfd = os.open(path, os.O_PATH)
        ok = ok and libc.syscall(445, fd, ctypes.c_int(1), ctypes.byref(Beneath(access, pfd)), ctypes.c_uint32(0)) == 0
        os.close(pfd)
    ok = ok and libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    ok = ok and libc.syscall(446, fd, ctypes.c_uint32(0)) == 0
    if ok:
        held += ["landlock_fs"] + (["landlock_tcp"] if net else []) + (["landlock_signals"] if scoped else [])


class SandboxRefused(PermissionError):
    pass


def _audit_hook(work, max_procs):
    """PEP 578 hook: a second layer with clear messages (removable by the code; the kernel's layers hold)."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    refused = {"socket.__new__", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata",
               "os.kill", "os.killpg", "signal.pthread_kill", "os.setuid", "os.chroot", "resource.setrlimit",
               "resource.prlimit", "os.system"}
    if max_procs == 1:
        refused |= {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "subprocess.Popen"}
    path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                   "os.rename", "os.link", "os.symlink", "shutil.rmtree", "os.mkfifo", "os.mknod"}

    def inside(path):
        if isinstance(path, int):
            return True
        path = os.path.realpath(os.fsdecode(path))
        return path == "/dev/null" or path == work or path.startswith(work + os.sep)

    def hook(event, args):
        if event in refused:
            raise SandboxRefused(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in ("ctypes", "_ctypes", "cffi"):
            raise SandboxRefused(f"sandbox: import {args[0]} is not allowed")
        if event == "open" and args[0] is not None:
            mode, flags = args[1] or "", args[2] or 0
            if (any(c in mode for c in "wax+") or flags & write_flags) and not inside(args[0]):
                raise SandboxRefused(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
        elif event in path_events:
            if not all(inside(p) for p in args[:2] if isinstance(p, (str, bytes, os.PathLike))):
                raise SandboxRefused(f"sandbox: {event} outside the sandbox directory is not allowed")
    sys.addaudithook(hook)


def main():
    job_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(job_fd, "rb") as f:
        job = json.loads(f.read())
    nonce, work = job["nonce"], job["dir"]

    def report(line):
        os.write(result_fd, f"{nonce} {line}\n".encode())

    held = []
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_CPU, job["cpu_s"], job["cpu_s"] + 1) and held.append("cpu")
    _limit(resource.RLIMIT_AS, job["memory_bytes"]) and held.append("memory")
    _limit(resource.RLIMIT_FSIZE, job["file_bytes"]) and held.append("file_size")
    _limit(resource.RLIMIT_NOFILE, job["open_files"])
    if job["nproc"] and _limit(resource.RLIMIT_NPROC, job["nproc"]):
        held.append("nproc")
    if job["weak"]:
        _landlock(work, held)
        for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
            del sys.modules[name]  # a later import is an import again, which the hook refuses
    for name, text in (("main.py", job["code"]), ("tests.py", job["tests"])):
        if text is not None:  # on disk for the tracebacks' source lines
            with open(os.path.join(work, name), "w") as f:
                f.write(text)
    report("start " + json.dumps(held))
    # at the soft CPU limit: signed here (bwrap reports a signal as an exit status, which the code could fake)
    signal.signal(signal.SIGXCPU, lambda *_: (report("cpu_time"), os._exit(128 + signal.SIGXCPU)))
    _audit_hook(work, job["max_procs"])
    sys.argv = ["main.py"]
    scope = {"__name__": "__main__", "__file__": os.path.join(work, "main.py"), "__builtins__": __builtins__}
    try:
        exec(compile(job["code"], os.path.join(work, "main.py"), "exec"), scope)
        if job["tests"] is not None:
            exec(compile(job["tests"], os.path.join(work, "tests.py"), "exec"), scope)
            report("passed")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the code's error, told from its own frames on
        if isinstance(exc, (MemoryError, SandboxRefused)):
            report("memory" if isinstance(exc, MemoryError) else "refused")
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
