"""The bubblewrap command of the sandbox (https://github.com/containers/bubblewrap, the sandbox Flatpak uses): new
user, PID, mount, net, IPC and UTS namespaces, uid 65534, read-only /usr and runtime, a capped tmpfs as work
directory, an empty environment; every process dies with the call (docs/agents.md, "The sandbox")."""
from __future__ import annotations

import os
import platform
import shutil
import stat
import struct
import sys

__all__ = ["WORK", "NOBODY", "find_bwrap", "runtime_paths", "host_uid", "bwrap_command", "no_process_filter"]

WORK = "/work"
NOBODY = 65534
_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # merged-/usr symlinks, or directories


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


def runtime_paths() -> tuple[str, list[str]]:
    """The real interpreter and the directories to bind read-only for it (its prefix, unless under /usr). The venv is
    not bound: the sandbox has the standard library only."""
    python = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    binds = [] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix]
    if not python.startswith(tuple(p + os.sep for p in ["/usr", *binds])):
        binds.append(os.path.dirname(python))
    return python, binds


def _reachable_by_others(path: str) -> bool:
    """Whether any user may read ``path`` (an interpreter under a 0700 home such as /root is unusable by uid 65534)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:i]) or "/").st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


def host_uid() -> int:
    """The uid bwrap runs as on the host: a root caller's sandbox runs as 65534 where the interpreter is readable
    by others (then RLIMIT_NPROC binds: the kernel never applies it to uid 0), else as the caller."""
    uid = os.geteuid()
    if uid != 0:
        return uid
    python, binds = runtime_paths()
    return NOBODY if all(_reachable_by_others(p) for p in [python, *binds]) else 0


def bwrap_command(bwrap: str, disk_bytes: int, seccomp_fd: int | None = None) -> list[str]:
    """The command running the interpreter in a fresh sandbox; ``seccomp_fd``: a filter for bwrap to load first."""
    python, binds = runtime_paths()
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
           "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK, "--setenv", "TMPDIR", WORK,
           "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONIOENCODING", "utf-8", "--ro-bind", "/usr", "/usr"]
    for top in _TOP_LEVEL:
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    for path in binds:
        cmd += ["--ro-bind", path, path]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", WORK, "--chdir", WORK,
            "--remount-ro", "/dev", "--remount-ro", "/"]
    cmd += ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    cmd += ["--", python, "-I"]
    return cmd


# (AUDIT_ARCH, clone, clone3, fork, vfork) of the machines the filter knows; syscall numbers from the kernel's
# syscall tables (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h)
_ARCHES = {"x86_64": (0xC000003E, 56, 435, 57, 58), "aarch64": (0xC00000B7, 220, 435, None, None)}


def no_process_filter() -> bytes | None:
    """A seccomp BPF program (bwrap ``--seccomp``): threads yes, processes no, whatever the uid (RLIMIT_NPROC spares
    root). clone without CLONE_THREAD, fork and vfork fail with EAGAIN, clone3 with ENOSYS (glibc falls back to clone),
    other ABIs' syscalls too. None on a machine it does not know."""
    arch = _ARCHES.get(platform.machine())
    if arch is None:
        return None
    audit, clone, clone3, fork, vfork = arch
    allow, eagain, enosys = 0x7FFF0000, 0x00050000 | 11, 0x00050000 | 38

    def op(code, k, jt=0, jf=0):
        return struct.pack("HBBI", code, jt, jf, k)
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    prog = [op(ld, 4), op(jeq, audit, 1, 0), op(ret, enosys), op(ld, 0),  # seccomp_data.arch, then .nr
            op(jge, 0x40000000, 0, 1), op(ret, enosys)]  # x32's numbers
    for nr, answer in ((fork, eagain), (vfork, eagain), (clone3, enosys)):
        if nr is not None:
            prog += [op(jeq, nr, 0, 1), op(ret, answer)]
    prog += [op(jeq, clone, 0, 4), op(ld, 16), op(jset, 0x00010000, 0, 1),  # args[0], low word: CLONE_THREAD
             op(ret, allow), op(ret, eagain), op(ret, allow)]
    return b"".join(prog)
