"""verl_ds.agent.sandbox: untrusted code ends with a status, within its limits, and leaves the caller and the
file system as they were. Each abuse case runs a real child process: in bubblewrap's sandbox (the default; these
tests skip, saying why, where it cannot run) and, where stated, in the weak one (tests/agent/test_sandbox_escapes.py
holds the escapes that only the namespaces stop)."""
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from verl_ds.agent import sandbox
from verl_ds.agent.sandbox import STATUSES, SandboxLimits, SandboxResult, run_python

FAST = SandboxLimits(timeout_s=5, cpu_s=2, memory_mb=256)
BWRAP_OK, BWRAP_LINE = sandbox._probe()
pytestmark = pytest.mark.skipif(not BWRAP_OK, reason=f"no bubblewrap sandbox here: {BWRAP_LINE}")


def test_plain_code_runs_with_stdin_and_its_own_directory():
    r = run_python("import os, sys\nprint(sum(map(int, sys.stdin.read().split())))\n"
                   "open('scratch.txt', 'w').write('kept inside')\nprint(os.getcwd() == os.environ['HOME'])", FAST,
                   stdin="1 2 3 4")
    assert r.status == "ok" and r.returncode == 0 and r.stdout.split() == ["10", "True"], r
    assert r.summary() == r.stdout


def test_the_environment_holds_nothing_of_the_callers(monkeypatch):
    monkeypatch.setenv("VERL_DS_SERVER_TOKEN", "s3cret-token")
    r = run_python("import os\nprint(sorted(os.environ))", FAST)
    assert r.ok and "s3cret" not in r.stdout and "VERL_DS_SERVER_TOKEN" not in r.stdout, r.stdout


@pytest.mark.parametrize("backend", ["bwrap", "weak"])
def test_the_directory_is_removed_afterwards(backend):
    r = run_python("import os\nprint(os.getcwd())", FAST, backend=backend)
    assert r.ok and (backend == "bwrap" or not os.path.exists(r.stdout.strip()))
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("verl_ds_sandbox_")] or backend == "weak"


def test_an_infinite_loop_ends_at_its_cpu_limit():
    r = run_python("while True:\n    pass", SandboxLimits(timeout_s=10, cpu_s=1))
    assert r.status == "cpu_time" and r.seconds < 5, r


def test_a_sleeping_loop_ends_at_the_wall_clock_timeout():
    r = run_python("import time\nwhile True:\n    time.sleep(0.1)", SandboxLimits(timeout_s=1, cpu_s=5))
    assert r.status == "timeout" and 1 <= r.seconds < 4, r


@pytest.mark.parametrize("backend", ["bwrap", "weak"])
def test_a_memory_bomb_ends_with_memory(backend):
    r = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", FAST, backend=backend)
    assert r.status == "memory" and "MemoryError" in r.stderr, r


@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    os.fork()",
    "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'pass'])",
    "import multiprocessing as mp\nwhile True:\n    mp.Process(target=print).start()",
    "import os\nos.system('sh -c \"while :; do :& done\"')",
])
@pytest.mark.parametrize("backend", ["bwrap", "weak"])
def test_a_fork_bomb_is_refused(bomb, backend):
    r = run_python(bomb, FAST, backend=backend)
    assert r.status == "refused" and "is not allowed" in r.stderr, r


@pytest.mark.parametrize("backend", ["bwrap", "weak"])
def test_a_write_outside_the_directory_is_refused(tmp_path, backend):
    target = tmp_path / "escaped.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", FAST, backend=backend)
    assert r.status == "refused" and not target.exists(), r
    r = run_python(f"import os\nos.remove({str(tmp_path)!r})", FAST, backend=backend)
    assert r.status == "refused" and tmp_path.exists(), r


def test_landlock_refuses_a_write_the_audit_hook_cannot_see_in_the_weak_sandbox(tmp_path):
    # a path relative to a directory fd looks like it is inside the sandbox to the hook; Landlock sees the real one
    probe = run_python("pass", FAST, backend="weak")
    if "landlock_fs" not in probe.isolation:
        pytest.skip(f"no Landlock on this kernel (isolation: {probe.isolation})")
    r = run_python(f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                   f"os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)", FAST, backend="weak")
    assert r.status == "error" and "Permission denied" in r.stderr, r
    assert not (tmp_path / "escaped.txt").exists()


def test_a_flood_of_output_is_cut_at_the_cap():
    r = run_python("while True:\n    print('y' * 4096)", SandboxLimits(timeout_s=10, max_output_bytes=20000))
    assert r.status == "output_limit" and r.truncated and len(r.stdout) == 20000, (r.status, len(r.stdout))


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "import ctypes",
    "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
    "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
])
def test_network_ctypes_signals_and_limits_are_refused(code):
    r = run_python(code, FAST)
    assert r.status == "refused", r


def test_an_exception_is_an_error_with_its_traceback():
    r = run_python("raise ValueError('bad answer')", FAST)
    assert r.status == "error" and r.returncode == 1 and "ValueError: bad answer" in r.summary(), r


def test_runs_in_parallel_leave_the_caller_alone():
    codes = ["while True: pass", "print('fine')", "x = bytearray(8 << 30)", "import os; os.fork()"] * 2
    threads_before = threading.active_count()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: run_python(c, SandboxLimits(timeout_s=5, cpu_s=1, memory_mb=256)), codes))
    assert [r.status for r in results] == ["cpu_time", "ok", "memory", "refused"] * 2
    assert all(isinstance(r, SandboxResult) and r.status in STATUSES for r in results)
    assert threading.active_count() == threads_before


@pytest.mark.parametrize("kwargs, message", [
    (dict(code=b"print(1)"), "code must be a str"),
    (dict(code="pass", stdin="x" * 70000), "stdin holds at most"),
    (dict(code="pass", max_procs=0), "max_procs must be an int"),
    (dict(code="pass", tests=["assert 1"]), "tests a str or None"),
    (dict(code="pass", backend="docker"), "backend must be None, 'bwrap' or 'weak'"),
])
def test_bad_arguments_name_what_was_wrong(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        run_python(**kwargs)


@pytest.mark.parametrize("field", ["timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "disk_mb", "max_files"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be a positive number"):
        SandboxLimits(**{field: 0})


def test_the_sandbox_reports_its_namespaces_and_the_runtime_only():
    r = run_python("import os\nprint(os.getuid(), os.getpid(), os.getcwd(), *sorted(os.listdir('/')))", FAST)
    uid, pid, cwd, *top = r.stdout.split()
    assert r.ok and uid == "65534" and pid == "2" and cwd == "/work", r  # bwrap's init is pid 1
    assert {"namespaces", "disk", "inodes", "no_processes", "cpu", "memory"} <= set(r.isolation), r.isolation
    # /usr and the merged-/usr links, the interpreter's prefix (here maybe under /root), /proc, /dev, /work
    assert set(top) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "proc", "dev", "work", "root",
                        "opt"}, top


@pytest.mark.skipif(not os.path.isdir("/work"), reason="the host has no /work for a child's unpivoted root to show")
def test_the_work_directory_is_counted_only_once_it_is_the_sandboxs_tmpfs():
    # before bwrap's child pivots into its new root, /proc/<child>/root/work is the host's /work: its entry count
    # (a whole disk's) once ended a call at start as disk_limit
    import subprocess

    parent = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        for _ in range(200):
            if os.path.exists(f"/proc/{parent.pid}/task/{parent.pid}/children") and \
                    open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split():
                break
            threading.Event().wait(0.01)
        assert sandbox._inodes_used(parent.pid, FAST.disk_mb << 20) is None
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()
