"""The control plane on a real 2-rank training run: hot updates and a reward swap take effect from the
announced step on, on both ranks (metrics are averaged over ranks, so a rank that missed an update would
show as a half-way value), and every applied change is in state_changes.jsonl."""
import json
import os
import subprocess
import sys
import time

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, free_port, merged, read_metrics
from server_testutil import TOKEN, call
from verl_ds import client
from verl_ds.server import URL_FILE

pytestmark = pytest.mark.slow  # real training runs / several processes

TOTAL_STEPS = 8  # room for the changes to land mid-run even when steps take under a second
CONST_REWARD = 0.123  # no parity score is this, so the swapped reward is unmistakable


def _wait(predicate, proc, what: str, log_path: str):
    """Poll until ``predicate()`` is truthy; fail with the run's output if the run ends first (a hung run is
    ended by pytest's per-test timeout)."""
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                tail = fh.read()[-6000:]
            raise AssertionError(f"training run ended (exit {proc.returncode}) before {what}:\n{tail}")
        time.sleep(0.05)


def _read(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def _step_records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    return [m for m in read_metrics(out) if "rollout/score/mean" in m]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A 2-rank run with the server on; a PATCH and a reward swap as soon as step 1 is logged."""
    tmp = tmp_path_factory.mktemp("e2e_server")
    out = str(tmp / "run")
    reward_file = tmp / "const_reward.py"
    reward_file.write_text(f"def const(prompts, responses, batch):\n    return [{CONST_REWARD}] * len(responses)\n")
    args = merged([f"trainer.output_dir={out}"], FAST, [
        f"trainer.total_steps={TOTAL_STEPS}", "trainer.val_every=0", "trainer.export=none", "trainer.save_every=0",
        "server.enabled=true", "algo.kl_ctrl=fixed", "algo.kl_coef=0.01", "rollout.temperature=1.0",
        f'server.swappable_rewards=["{reward_file}:const"]'])  # the only code the server may swap in
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           TRAIN, *args]
    log_path = str(tmp / "train.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=base_env(VERL_DS_SERVER_TOKEN=TOKEN), stdout=log,
                                stderr=subprocess.STDOUT, text=True)
    try:
        url_file = os.path.join(out, URL_FILE)
        url = _wait(lambda: _read(url_file), proc, "the URL file", log_path)
        _wait(lambda: _step_records(out), proc, "step 1 was logged", log_path)
        health = call(url, "GET", "/healthz")
        models = call(url, "GET", "/v1/models")
        # the path a user takes: verl-ds state --run-dir RUN --token T set ...
        answer = client.run(client.build_parser().parse_args(
            ["--run-dir", out, "--token", TOKEN, "set", "kl_coef=0.05", "temperature=0.7"]))
        assert answer["staged"] == {"kl_coef": 0.05, "temperature": 0.7}
        patch_step = answer["applies_at_step"]
        swap = call(url, "POST", "/v1/models/reward", {"function": f"{reward_file}:const"}, token=TOKEN)
        assert swap.status == 202, swap
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        output = fh.read()
    assert proc.returncode == 0, output[-6000:]
    return {"out": out, "url": url, "patch_step": patch_step, "swap": swap.json, "health": health,
            "models": models, "output": output}


def test_patch_of_kl_coef_and_temperature_applies_from_the_announced_step_on_both_ranks(live_run):
    out, s = live_run["out"], live_run["patch_step"]
    assert 2 <= s <= TOTAL_STEPS - 1, f"PATCH landed at step {s}; the run was too fast to test before/after"
    records = _step_records(out)
    assert [m["step"] for m in records] == list(range(1, TOTAL_STEPS + 1))
    for m in records:
        want = (0.05, 0.7) if m["step"] >= s else (0.01, 1.0)
        # metrics pass through float32 tensors: equal to 1e-6, far from any half-way (rank-averaged) value
        assert (m["actor/kl_coef"], m["state/temperature"]) == pytest.approx(want, rel=1e-6), (m["step"], s)
    changes = [json.loads(line) for line in open(os.path.join(out, "state_changes.jsonl"))]
    by_key = {c["key"]: c for c in changes}
    assert by_key["kl_coef"] == {**by_key["kl_coef"], "step": s, "old": 0.01, "new": 0.05, "client": "127.0.0.1"}
    assert by_key["temperature"] == {**by_key["temperature"], "step": s, "old": 1.0, "new": 0.7}
    assert live_run["health"].json["status"] == "ok"
    ids = {m["id"] for m in live_run["models"].json["data"]}
    assert {"actor", "critic", "ref", "reward"} <= ids
    assert live_run["url"] in live_run["output"]  # the URL was announced
    assert not os.path.exists(os.path.join(out, URL_FILE))  # removed when the server stopped


def test_reward_swap_mid_run_changes_the_reward_from_the_announced_step(live_run):
    out, swap = live_run["out"], live_run["swap"]
    s2 = swap["applies_at_step"]
    assert 2 <= s2 <= TOTAL_STEPS, f"swap landed at step {s2}; the run was too fast to test before/after"
    records = _step_records(out)
    v0 = records[0]["state/reward_version"]
    for m in records:
        if m["step"] >= s2:
            assert abs(m["rollout/score/mean"] - CONST_REWARD) < 1e-6 and m["state/reward_version"] == v0 + 1, m["step"]
        else:
            assert abs(m["rollout/score/mean"] - CONST_REWARD) > 1e-3 and m["state/reward_version"] == v0, m["step"]
    changes = [json.loads(line) for line in open(os.path.join(out, "state_changes.jsonl"))]
    reward = [c for c in changes if c["key"] == "reward"]
    assert len(reward) == 1 and reward[0]["step"] == s2 and reward[0]["client"] == "127.0.0.1"
    assert reward[0]["new"].endswith("const_reward.py:const")
