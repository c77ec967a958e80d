"""The sandbox started by an unprivileged trainer (uid 65534, through setpriv): bubblewrap runs as that user, so
RLIMIT_NPROC binds (the kernel never applies it to uid 0) and a process bomb with the audit hook removed stops at
max_procs. The sandbox modules run from a copy under /tmp with the system Python: the venv's interpreter may live
where uid 65534 cannot reach (a 0700 /root)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from verl_ds.agent import sandbox

HERE = os.path.dirname(os.path.abspath(sandbox.__file__))
SYSTEM_PYTHON = "/usr/bin/python3"
SETPRIV = shutil.which("setpriv")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None or not os.access(SYSTEM_PYTHON, os.X_OK) or shutil.which("bwrap") is None,
    reason="needs root (to drop to uid 65534), setpriv, /usr/bin/python3 and bwrap")

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from sbx import sandbox
from sbx.sandbox import SandboxLimits, run_python
unhook = open(sys.argv[2]).read()
bomb = unhook + '''
import os, time
n = 0
try:
    while n < 50:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print("stopped", e)
print("forks", n)
'''
out = {"line": sandbox.require_sandbox(False)}
r = run_python(bomb, SandboxLimits(timeout_s=10, cpu_s=5), max_procs=3)
out["bomb"] = [r.status, r.stdout, r.stderr[-500:], list(r.isolation)]
r = run_python("import os\nprint(os.getuid(), len(open('/etc/passwd').read()) if os.path.exists('/etc/passwd') else 0)")
out["plain"] = [r.status, r.stdout, list(r.isolation)]
print(json.dumps(out))
"""


def test_an_unprivileged_trainer_gets_a_process_bound(tmp_path):
    from test_sandbox_escapes import UNHOOK

    pkg = tempfile.mkdtemp()
    os.makedirs(os.path.join(pkg, "sbx"))
    for name in ("sandbox.py", "bwrap.py", "sandbox_runner.py"):
        with open(os.path.join(HERE, name)) as f:
            text = f.read().replace("from verl_ds.agent import bwrap", "from sbx import bwrap")
        with open(os.path.join(pkg, "sbx", name), "w") as f:
            f.write(text)
    open(os.path.join(pkg, "sbx", "__init__.py"), "w").close()
    with open(os.path.join(pkg, "unhook.py"), "w") as f:
        f.write(UNHOOK)
    for root, dirs, files in os.walk(pkg):
        os.chmod(root, 0o755)
        for n in files:
            os.chmod(os.path.join(root, n), 0o644)
    try:
        r = subprocess.run([SETPRIV, "--reuid", "65534", "--regid", "65534", "--clear-groups", SYSTEM_PYTHON, "-I",
                            "-c", SCRIPT, pkg, os.path.join(pkg, "unhook.py")],
                           capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": os.environ["PATH"]})
    finally:
        shutil.rmtree(pkg, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "host uid 65534" in out["line"] and "does not bind" not in out["line"], out
    status, stdout, stderr, isolation = out["bomb"]
    assert "UNHOOKED" in stdout and "nproc" in isolation and "host_uid_65534" in isolation, out["bomb"]
    forks = int(stdout.split("forks")[1])
    assert forks <= 3 and "Resource temporarily unavailable" in stdout, out["bomb"]  # max_procs=3
    assert out["plain"][0] == "ok" and out["plain"][1].split() == ["65534", "0"], out["plain"]  # no /etc inside
