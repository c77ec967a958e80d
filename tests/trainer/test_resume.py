"""Resume follows what the run did, not what the config says: the KL controller of the checkpointed kind, a reward
swapped over HTTP, hot changes applied after the checkpoint (replayed at their steps), and a run that goes
non-finite right after resuming falls back once to the previous checkpoint. Real runs, real HTTP, real files."""
import pytest
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

from e2e_utils import FAST, ROOT, TRAIN, base_env, merged, read_metrics, run_train

pytestmark = pytest.mark.slow  # real training runs / several processes

TOKEN = "resume-test-token"
CONST = 0.25
CONST_REWARD = f"def const(prompts, responses, batch):\n    return [{CONST}] * len(responses)\n"


def _request(url: str, method: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method=method,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read().decode())


def _run_with_request(out: str, overrides: list, method: str, path: str, body: dict, env_extra=None):
    """A training run with the control server on; ``body`` is sent as soon as the server's URL appears.
    Returns (the finished process, the server's answer)."""
    url_file = os.path.join(out, "server_url.txt")
    args = [sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, ["server.enabled=true"], overrides)]
    env = base_env(VERL_DS_SERVER_TOKEN=TOKEN, **(env_extra or {}))
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    answer = {}

    def send():
        while proc.poll() is None and not os.path.isfile(url_file):
            time.sleep(0.05)
        if proc.poll() is None:
            url = open(url_file).read().strip()
            answer.update(_request(url, method, path, body))

    sender = threading.Thread(target=send)
    sender.start()
    stdout, stderr = proc.communicate(timeout=900)
    sender.join()
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), answer


def test_resume_keeps_the_checkpointed_kl_controller_and_the_swapped_reward(tmp_path):
    """Run 1: band controller, a reward swapped over HTTP before step 1. Run 2 resumes with kl_ctrl=ziegler in the
    config: no crash, the checkpoint's band controller and swapped reward stay, one log line per disagreeing key."""
    reward_file = tmp_path / "const.py"
    reward_file.write_text(CONST_REWARD)
    spec = f"{reward_file}:const"
    out = str(tmp_path / "run")
    common = ["algo.kl_ctrl=band", "trainer.export=none", "trainer.val_every=0", f"server.swappable_rewards=[{spec}]"]
    first, answer = _run_with_request(out, [*common, "trainer.total_steps=3"], "POST", "/v1/models/reward",
                                      {"function": spec})
    assert first.returncode == 0, first.stderr[-4000:]
    assert answer["applies_at_step"] <= 3, answer
    second = run_train(out, ["algo.kl_ctrl=ziegler", "trainer.total_steps=5", "trainer.export=none",
                             "trainer.val_every=0", f"server.swappable_rewards=[{spec}]"])
    log = second.stdout + second.stderr
    assert "resumed from" in log
    assert "kl_ctrl_type = 'band' from the checkpoint (a hot value) wins over the config's 'ziegler'" in log
    steps = {m["step"]: m for m in read_metrics(out) if "rollout/score/mean" in m}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    for s in (4, 5):  # after the resume: still the swapped reward
        assert abs(steps[s]["rollout/score/mean"] - CONST) < 1e-6, steps[s]
        assert steps[s]["state/reward_version"] == 1.0
    ckpt_state = json.load(open(os.path.join(out, "checkpoints", "global_step_5", "trainer_state.json")))
    assert ckpt_state["models"]["ppo"]["kl_controller"]["kind"] == "band"
    assert ckpt_state["reward_spec"]["functions"] == [{"name": spec, "weight": 1.0, "per_token": False}]


def test_hot_changes_after_the_checkpoint_are_replayed_after_a_crash(tmp_path):
    """Run 1 checkpoints step 2. Run 2 resumes, a PATCH kl_coef=0.2 applies at the step its answer announces (3 or 4:
    the request races the first step), and the job is killed at the start of step 7 (no newer checkpoint). Run 3
    resumes from step 2: from the announced step on it runs with kl_coef 0.2 as the crashed run did, and the audit
    log records the replay."""
    out = str(tmp_path / "run")
    common = ["algo.kl_ctrl=fixed", "algo.kl_coef=0.01", "trainer.export=none", "trainer.val_every=0"]
    run_train(out, [*common, "trainer.total_steps=2"])
    crashed, answer = _run_with_request(out, [*common, "trainer.total_steps=8"], "PATCH", "/v1/state",
                                        {"kl_coef": 0.2}, env_extra={"VERL_DS_FAULT": "kill_at=step_begin:step=7"})
    at = answer["applies_at_step"]
    assert crashed.returncode != 0 and 3 <= at <= 6, (crashed.returncode, answer)
    logged = {m["step"]: m for m in read_metrics(out) if "rollout/score/mean" in m}
    assert logged[at]["actor/kl_coef"] == 0.2 and logged[at - 1]["actor/kl_coef"] == 0.01
    third = run_train(out, [*common, "trainer.total_steps=8"])
    assert "resumed from" in third.stdout + third.stderr
    steps = {m["step"]: m for m in read_metrics(out) if "rollout/score/mean" in m}
    assert sorted(steps) == list(range(1, 9))
    assert [steps[s]["actor/kl_coef"] for s in range(1, 9)] == [0.01] * (at - 1) + [0.2] * (9 - at)
    audit = [json.loads(line) for line in open(os.path.join(out, "state_changes.jsonl"))]
    assert [(a["step"], a["key"], a["new"], a.get("replayed", False)) for a in audit] == \
        [(at, "kl_coef", 0.2, False), (at, "kl_coef", 0.2, True)]


def test_non_finite_right_after_resume_falls_back_once_to_the_previous_checkpoint(tmp_path):
    """Checkpoints at steps 2 and 4; the resumed run gets NaN logits at steps 5-6 (max_bad_steps=2): instead of
    stopping it falls back once to step 2 and trains on (the injected NaNs were transient); every step is logged once."""
    out = str(tmp_path / "run")
    common = ["trainer.save_every=2", "trainer.keep_last=3", "trainer.max_bad_steps=2", "trainer.export=none",
              "trainer.val_every=0"]
    run_train(out, [*common, "trainer.total_steps=4"])
    proc = run_train(out, [*common, "trainer.total_steps=8"], env=base_env(VERL_DS_FAULT="nan_logits_at_step=5-6"))
    log = proc.stdout + proc.stderr
    assert log.count("falling back once to the previous complete checkpoint") == 1 and "global_step_2" in log
    steps = [m["step"] for m in read_metrics(out) if "rollout/score/mean" in m]
    assert steps == list(range(1, 9))


def test_a_run_ended_by_non_finite_values_checkpoints_first(tmp_path):
    """No checkpoint to fall back to: max_bad_steps non-finite steps in a row end the run with NonFiniteError, after a
    checkpoint of the step reached (the bad steps skipped their updates, so the weights are sound)."""
    out = str(tmp_path / "run")
    proc = run_train(out, ["trainer.total_steps=6", "trainer.max_bad_steps=2", "trainer.export=none",
                           "trainer.val_every=0"], check=False, env=base_env(VERL_DS_FAULT="nan_logits_at_step=2-3"))
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NonFiniteError" in log, log[-3000:]
    assert "the run is ending on a fault at step 3: checkpoint" in log
    assert os.path.isfile(os.path.join(out, "checkpoints", "global_step_3", "COMPLETE"))


def test_a_fresh_run_in_a_used_directory_does_not_mix_in_the_old_metrics(tmp_path, two_rank_start):
    """trainer.resume=none into a directory with a finished run: the new metrics.jsonl holds the new run only (the
    old one is kept as metrics.jsonl.prev), so the summary covers this run."""
    out = two_rank_start(str(tmp_path / "run"))  # a finished run of 2 steps (conftest.py)
    run_train(out, ["trainer.export=none", "trainer.val_every=0", "trainer.total_steps=1", "trainer.resume=none"])
    assert [m["step"] for m in read_metrics(out) if "rollout/score/mean" in m] == [1]
    previous = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl.prev"))]
    assert [s for s in previous if s > 0] == [1, 2]


def test_a_run_checkpointed_on_two_ranks_resumes_on_one(tmp_path, two_rank_start):
    """Elastic resume through the trainer: 2 steps on 2 ranks, then steps 3-4 on 1 rank from that checkpoint (the
    engines through DeepSpeed's universal checkpoint, the same global batches split over the new world size)."""
    out = two_rank_start(str(tmp_path / "run"))  # 2 steps on 2 ranks, no validation (conftest.py)
    proc = run_train(out, ["trainer.export=none", "trainer.val_every=0", "trainer.total_steps=4"])
    assert "resumed from" in proc.stdout + proc.stderr
    steps = [m for m in read_metrics(out) if "rollout/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(m["training/nonfinite_steps"] == 0 for m in steps)
