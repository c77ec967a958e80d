"""The escapes found by probing the first sandbox (an audit hook, Landlock, rlimits), each tried in bubblewrap's
sandbox as is and after the five-line removal of the audit hook (so the kernel's layers are what holds). Each
attack prints what it reached; the host side checks that nothing was reached or changed. Run as root, as CI runs;
test_sandbox_unprivileged.py runs the ones whose behaviour differs as uid 65534."""
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from verl_ds.agent import sandbox
from verl_ds.agent.sandbox import SandboxLimits, run_python

OK, LINE = sandbox._probe()
pytestmark = pytest.mark.skipif(not OK, reason=f"no bubblewrap sandbox here: {LINE}")
LIMITS = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=512)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The hook removal of the review: find the hook through the garbage collector, give it a body that allows all.
UNHOOK = """import gc
for f in [o for o in gc.get_objects() if getattr(o, "__name__", "") == "hook" and hasattr(o, "__code__")]:
    n = len(f.__code__.co_freevars); ns = {}; names = ','.join('v%d' % i for i in range(n))
    exec(f"def outer({names}):\\n def hook(event, args):\\n  return ({names},)\\n return hook", ns)
    f.__code__ = ns["outer"](*range(n)).__code__
import ctypes; print("UNHOOKED", flush=True)
"""
TRY = """def attempt(what, fn):
    try:
        print("REACHED", what, repr(fn())[:300], flush=True)
    except BaseException as e:
        print("DENIED", what, type(e).__name__, e, flush=True)
"""


def attack(code: str, unhook: bool, limits=LIMITS, **kw):
    r = run_python((UNHOOK if unhook else "") + TRY + code, limits, **kw)
    if unhook:
        assert "UNHOOKED" in r.stdout, r  # the removal worked: what follows met only the kernel's layers
    return r


@pytest.fixture
def victim():
    """A host process holding secrets in its environment and command line, as the trainer does."""
    secret = secrets.token_hex(8)
    env = {"PATH": "/usr/bin:/bin", "HF_TOKEN": secret, "VERL_DS_SERVER_TOKEN": secret}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"server.token={secret}"], env=env)
    yield proc, secret
    proc.kill()
    proc.wait()


def _host_processes_with(marker: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


UNHOOKS = pytest.mark.parametrize("unhook", [False, True], ids=["hooked", "unhooked"])


@UNHOOKS
@pytest.mark.parametrize("how", [
    "subprocess.Popen(['/bin/sh', '-c', 'sleep 60; : {m}'], start_new_session=True)",  # _posixsubprocess.fork_exec
    "multiprocessing.get_context('spawn').Process(target=os.execv, args=('/bin/sh', ['sh', '-c', 'sleep 60; : {m}']))"
    ".start()",
    "os.execv('/bin/sh', ['sh', '-c', 'sleep 60; : {m}']) if os.fork() == 0 and os.setsid() else None",
])
def test_no_process_outlives_the_call(unhook, how):
    marker = f"outlive_{secrets.token_hex(6)}"
    code = (f"import multiprocessing, os, subprocess, time\nattempt('start', lambda: {how.format(m=marker)})\n"
            "time.sleep(1)")
    r = attack(code, unhook, SandboxLimits(timeout_s=4, cpu_s=4), max_procs=4)
    # the call ends when its program does (multiprocessing's exit waits for its child: then at the timeout)
    assert r.status in ("ok", "timeout"), r
    if unhook:
        assert "REACHED start" in r.stdout, r  # it did start a process (max_procs=4), which died with the call
    time.sleep(0.5)
    assert _host_processes_with(marker) == [], r


@pytest.mark.parametrize("code", ["os.fork()", "subprocess.run(['/bin/true'])",
                                  "os.posix_spawn('/bin/true', ['t'], {})"])
def test_no_process_starts_at_max_procs_1_without_the_hook(code):
    r = attack(f"import os, subprocess\nattempt('fork', lambda: {code})", True)
    assert "REACHED" not in r.stdout and "DENIED fork" in r.stdout, r  # the seccomp filter, even for root


@UNHOOKS
def test_host_files_keep_their_mode_and_owner(tmp_path, unhook):
    target = tmp_path / "host_file"
    target.write_text("host")
    target.chmod(0o600)
    before = os.stat(target)
    code = (f"import os\np = {str(target)!r}\nattempt('chmod', lambda: os.chmod(p, 0o777))\n"
            f"attempt('chown', lambda: os.chown(p, 65534, 65534))\nattempt('utime', lambda: os.utime(p, (0, 0)))\n"
            f"attempt('write', lambda: open(p, 'w').write('x'))")
    r = attack(code, unhook)
    after = os.stat(target)
    assert (after.st_mode, after.st_uid, after.st_mtime) == (before.st_mode, before.st_uid, before.st_mtime), r
    assert target.read_text() == "host" and "REACHED" not in r.stdout, r.stdout


@UNHOOKS
def test_host_unix_sockets_are_out_of_reach(unhook):
    d = tempfile.mkdtemp()
    path, abstract = os.path.join(d, "runtime.sock"), f"\0verl_ds_test_{secrets.token_hex(6)}"
    servers = []
    for address in (path, abstract):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(4)
        s.setblocking(False)
        servers.append(s)
    os.chmod(d, 0o755)
    os.chmod(path, 0o777)
    code = (f"import socket\nfor a in ({path!r}, {abstract!r}):\n"
            f"    attempt(a, lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(a))")
    try:
        r = attack(code, unhook)
        for s in servers:
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody connected
    finally:
        for s in servers:
            s.close()
    assert "REACHED" not in r.stdout, r.stdout


@UNHOOKS
def test_udp_reaches_no_host_socket(unhook):
    host = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    host.bind(("127.0.0.1", 0))
    host.setblocking(False)
    port = host.getsockname()[1]
    code = (f"import socket\nattempt('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
            f".sendto(b'leak', ('127.0.0.1', {port})))")
    try:
        attack(code, unhook)
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            host.recvfrom(64)  # nothing arrived
    finally:
        host.close()


@UNHOOKS
def test_no_secret_of_another_process_is_readable(victim, unhook, monkeypatch):
    proc, secret = victim
    monkeypatch.setenv("HF_TOKEN", secret)  # the trainer's own environment too
    code = (f"import os\nfor pid in [{proc.pid}, {os.getpid()}, os.getppid(), 1] + "
            f"[p for p in os.listdir('/proc') if p.isdigit()]:\n"
            f"    for what in ('environ', 'cmdline', 'mem'):\n"
            f"        attempt(f'{{pid}}/{{what}}', lambda: open(f'/proc/{{pid}}/{{what}}', 'rb').read(4096))\n"
            f"attempt('own environ', lambda: dict(os.environ))")
    r = attack(code, unhook)
    assert secret not in r.stdout + r.stderr, r.stdout
    assert proc.poll() is None


@UNHOOKS
def test_the_checkout_the_run_directory_and_etc_are_unreadable(tmp_path, unhook):
    run_dir = tmp_path / "runs" / "job"
    run_dir.mkdir(parents=True)
    secret = secrets.token_hex(8)
    (run_dir / "metrics.jsonl").write_text(secret)
    paths = [os.path.join(CHECKOUT, "setup.py"), str(run_dir / "metrics.jsonl"), "/etc/passwd", "/etc/hostname",
             os.path.expanduser("~/.bashrc"), os.path.join(CHECKOUT, ".venv", "pyvenv.cfg")]
    code = "import os\n" + "".join(f"attempt({p!r}, lambda: open({p!r}).read())\n" for p in paths)
    code += "".join(f"attempt('ls ' + {d!r}, lambda: os.listdir({d!r}))\n" for d in (CHECKOUT, str(run_dir), "/etc"))
    r = attack(code, unhook)
    assert "REACHED" not in r.stdout and secret not in r.stdout, r.stdout


@UNHOOKS
def test_no_signal_reaches_a_host_process(victim, unhook):
    proc, _ = victim
    code = (f"import os, signal\nattempt('kill', lambda: os.kill({proc.pid}, signal.SIGKILL))\n"
            f"attempt('pidfd', lambda: signal.pidfd_send_signal(os.pidfd_open({proc.pid}), signal.SIGKILL))\n"
            f"attempt('parent', lambda: os.kill({os.getpid()}, signal.SIGKILL))")
    attack(code, unhook)
    time.sleep(0.2)
    assert proc.poll() is None  # the victim lives (and so does this test process)


@UNHOOKS
def test_dir_fd_writes_stay_inside(tmp_path, unhook):
    host_tmp = tempfile.gettempdir()
    name = f"escaped_{secrets.token_hex(6)}"
    code = (f"import os\nflags = os.O_WRONLY | os.O_CREAT\n"
            f"attempt('dir_fd', lambda: os.open({name!r}, flags, dir_fd=os.open({str(tmp_path)!r}, os.O_RDONLY)))\n"
            f"attempt('root fd', lambda: os.open('tmp/{name}', flags, dir_fd=os.open('/', os.O_RDONLY)))\n"
            f"attempt('dotdot', lambda: os.open('../tmp/{name}', flags))")
    r = attack(code, unhook)
    assert not (tmp_path / name).exists() and not os.path.exists(os.path.join(host_tmp, name)), r.stdout
    assert "REACHED" not in r.stdout, r.stdout


@UNHOOKS
def test_the_disk_is_bounded_and_gone_afterwards(unhook):
    code = """import os
def fill(path):
    n = 0
    with open(path, "wb") as f:
        while True:
            f.write(b"x" * (1 << 20)); f.flush(); n += 1
for path in ("/work/big", "/big", "/dev/shm/big", "/tmp/big", "/proc/big"):
    attempt(path, lambda: fill(path))
    print("SIZE", path, os.path.getsize(path) if os.path.exists(path) else 0)
"""
    r = attack(code, unhook, SandboxLimits(timeout_s=10, cpu_s=5, disk_mb=8, max_file_bytes=1 << 30))
    sizes = {line.split()[1]: int(line.split()[2]) for line in r.stdout.splitlines() if line.startswith("SIZE")}
    assert sizes["/work/big"] <= 8 << 20 and sum(sizes.values()) <= 8 << 20, r.stdout
    assert "REACHED" not in r.stdout, r.stdout  # each ended on an error (no space, read-only, none such)


@UNHOOKS
def test_a_flood_of_files_ends_at_the_cap(unhook):
    code = "import os\nn = 0\nwhile True:\n    os.mkdir(f'd{n}') if n % 2 else open(f'f{n}', 'w').close()\n    n += 1"
    r = attack(code, unhook, SandboxLimits(timeout_s=20, cpu_s=20, max_files=2000))
    assert r.status == "disk_limit", r  # not the CPU limit or the timeout


@pytest.mark.parametrize("code, status", [
    ("import sys\nprint('SandboxRefused: sandbox: os.fork is not allowed', file=sys.stderr)\nsys.exit(1)", "error"),
    ("import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)", "error"),
    ("import os\nfor fd in range(3, 12):\n    for word in ('refused', 'memory', 'cpu_time', 'passed'):\n"
     "        try: os.write(fd, f'x {word}\\n'.encode())\n        except OSError: pass\n"
     "raise SystemExit(152)", "error"),
])
def test_the_status_comes_from_the_harness_not_the_output(code, status):
    r = run_python(code, LIMITS, tests="pass")
    assert r.status == status and r.tests_passed is False, r
