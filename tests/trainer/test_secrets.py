"""The control-plane token given on the command line is never shown or stored: not in the printed config, not in any
file of the run directory (config.yaml, metrics, audit log, checkpoints, reports), not in the server's answers; the
run files that may hold operator input are private (0600)."""
import json
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, merged

pytestmark = pytest.mark.slow  # real training runs / several processes

TOKEN = "tok-9f3a1c77e2d54b0b8d6e"


def _send(url: str, token: str, body: dict):
    req = urllib.request.Request(url + "/v1/state", data=json.dumps(body).encode(), method="PATCH",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_token_on_the_command_line_appears_nowhere(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, [
        "trainer.total_steps=3", "server.enabled=true", f"server.token={TOKEN}", "trainer.save_every=1"])]
    proc = subprocess.Popen(args, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url_file = out / "server_url.txt"
    while proc.poll() is None and not url_file.is_file():
        time.sleep(0.05)
    answers = []
    if proc.poll() is None:
        url = url_file.read_text().strip()
        answers = [_send(url, TOKEN, {"kl_coef": 0.02}), _send(url, TOKEN + "x", {"kl_coef": 0.03}),
                   _send(url, TOKEN, {"temperature": -1})]
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    assert [a[0] for a in answers] == [202, 401, 400], answers
    assert "<redacted>" in stdout  # the printed resolved config shows that a token is set, not the token
    assert TOKEN not in stdout and TOKEN not in stderr
    for status, body in answers:
        assert TOKEN not in body
    seen = 0
    for root, _, files in os.walk(out):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                assert TOKEN.encode() not in fh.read(), f"the token leaked into {path}"
            seen += 1
    assert seen > 10  # config, metrics, audit, checkpoint files, reports
    for private in ("config.yaml", "state_changes.jsonl"):
        mode = stat.S_IMODE(os.stat(out / private).st_mode)
        assert mode == 0o600, f"{private} has mode {oct(mode)}"
    assert not url_file.exists()  # removed when the server stops
