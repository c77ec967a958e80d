"""The control plane of an agent run: the environment scores the trajectories, so a reward swap is refused with a
message (400) instead of being staged and silently ignored; hot changes are still accepted."""
import json
import os
import subprocess
import sys

import pytest

from e2e_utils import FAST, ROOT, base_env, merged

pytestmark = pytest.mark.slow  # builds a real trainer (DeepSpeed engines) in a subprocess

WORKER = r'''
import json, sys
from verl_ds.config import load_config
from verl_ds.dist import detect_launch
from verl_ds.trainer import Trainer
sys.path.insert(0, sys.argv[2])
from server_testutil import TOKEN, call

trainer = Trainer(load_config(None, sys.argv[4:]), detect_launch())
trainer.started()  # the job's own start: the control server on rank 0
server = trainer.server
swap = call(server.url, "POST", "/v1/models/reward", {"function": sys.argv[3]}, token=TOKEN)
patch = call(server.url, "PATCH", "/v1/state", {"temperature": 0.7}, token=TOKEN)
json.dump({"swap": [swap.status, swap.json], "patch": patch.status,
           "pending": trainer.boundary._pending_swap}, open(sys.argv[1], "w"))
trainer.close()
'''


def test_a_reward_swap_is_refused_in_an_agent_run(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    const = tmp_path / "const_reward.py"  # scores any row: on its own it would be a valid swap
    const.write_text("def const(prompts, responses, batch):\n    return [0.5] * len(responses)\n")
    args = merged([f"trainer.output_dir={tmp_path / 'run'}"], FAST, [
        "agent.environment=calc", "reward.functions=[]", "agent.max_turns=2", "server.enabled=true",
        "server.port=0", "trainer.device=cpu", f'server.swappable_rewards=["{const}:const"]'])
    result = tmp_path / "result.json"
    env = base_env(VERL_DS_SERVER_TOKEN="s3cret-token")
    proc = subprocess.run([sys.executable, str(worker), str(result), os.path.join(ROOT, "tests", "server"),
                           f"{const}:const", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(result.read_text())
    status, body = out["swap"]
    assert status == 400, out
    assert "agent.environment='calc'" in json.dumps(body) and "no effect" in json.dumps(body), body
    assert out["pending"] is None  # nothing staged
    assert out["patch"] == 202  # hot changes still go through
