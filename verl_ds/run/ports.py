"""The control server's address at start-up: bound once and released, as the server will bind it, so a busy port
or an address this machine does not have is refused before anything is built, naming the holder when the
kernel's tables say who it is (Linux ``/proc``; only processes of this user can be matched)."""
from __future__ import annotations

import errno
import os
import socket
from typing import Optional

from verl_ds.config import ConfigError

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def check_bind(host: str, port: int) -> None:
    """ConfigError naming server.port (in use, privileged) or server.host (not an address of this machine)
    when ``(host, port)`` cannot be bound the way ``ControlServer`` binds it (SO_REUSEADDR, then bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            holder = port_holder(port)
            raise ConfigError(f"server.port: {port} on {host} is already in use"
                              f"{f' by {holder}' if holder else ''}; expected a free port (or 0: any free port, "
                              "the URL is written to the run directory)") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"server.port: binding {host}:{port} is not permitted ({exc.strerror}; ports below "
                              "1024 need privileges); expected a port >= 1024, or 0 for any free port") from None
        raise ConfigError(f"server.host: cannot bind {host}:{port} ({exc.strerror or exc}); expected an address "
                          "of this machine, e.g. 127.0.0.1") from None
    finally:
        sock.close()


def port_holder(port: int) -> Optional[str]:
    """``"pid 123 (python)"`` of the process listening on TCP ``port``, or None when not knowable."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except (OSError, ValueError, IndexError):
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, _listdir("/proc")):
        for fd in _listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return f"pid {pid} ({_comm(pid)})"
            except OSError:
                continue
    return None


def _listdir(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:  # another user's process, or one that just exited
        return []


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"
