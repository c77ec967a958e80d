"""A reward swap to a neural scorer (``model_path``) in an asynchronous run is refused when it is staged (400,
naming ``rollout.mode``), as ``reward.model_path`` is refused in the config: the generation thread scores outside
the training ranks' collectives, where a reward model's forward cannot run. Before, it was answered 202 and then
failed where the samples are scored. A one-rank streaming run with the control server on 127.0.0.1."""
import json
import os
import signal
import subprocess
import sys

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, merged, read_metrics, wait_until
from server_testutil import TOKEN, call

pytestmark = pytest.mark.slow  # a real training run


def _steps(out: str) -> list:
    if not os.path.isfile(os.path.join(out, "metrics.jsonl")):
        return []
    return [m["step"] for m in read_metrics(out) if "training/global_step" in m]


def test_a_reward_model_swap_is_refused_when_staged_in_a_streaming_run(tmp_path):
    rm = tmp_path / "rms" / "scorer"  # passes every check of the swap's model_path (config.json, weights file)
    rm.mkdir(parents=True)
    (rm / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                "num_labels": 1, "vocab_size": 4096}))
    (rm / "model.safetensors").write_bytes(b"")
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")
    args = [sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, [
        "server.enabled=true", f"server.reward_model_dir={tmp_path / 'rms'}", "rollout.mode=streaming",
        "rollout.max_staleness=1", "trainer.total_steps=400", "trainer.save_every=0", "trainer.val_every=0",
        "trainer.export=none"])]
    with open(log, "w") as fh:
        proc = subprocess.Popen(args, cwd=ROOT, env=base_env(VERL_DS_SERVER_TOKEN=TOKEN), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url_file = os.path.join(out, "server_url.txt")
        url = wait_until(proc, lambda: os.path.isfile(url_file) and open(url_file).read().strip(), "the server URL", log)
        wait_until(proc, lambda: _steps(out), "step 1", log)
        r = call(url, "POST", "/v1/models/reward", {"model_path": str(rm)}, token=TOKEN)
        assert r.status == 400, (r.status, r.json)
        assert r.json["error"].startswith("reward swap: model_path is refused with rollout.mode=streaming: a reward "
                                          "model's forward is a collective"), r.json
        seen = len(_steps(out))
        wait_until(proc, lambda: len(_steps(out)) >= seen + 2, "two more steps", log)  # the run goes on, nothing staged
        audit = os.path.join(out, "state_changes.jsonl")
        assert not os.path.isfile(audit) or all(json.loads(x)["key"] != "reward" for x in open(audit))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
