"""Issue 31, "accepted, then fatal" (items 6-12), on real one-rank training runs with the control server on
127.0.0.1: each request that used to be answered 202 and then end the run is now a 400, or is rolled back at the
step boundary with an audit line while the run goes on; a replayed change that fails is refused instead of
re-killing the run; a change lost in a crash before its step is applied after the resume, at its step."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, free_port, merged, read_metrics, run_train
from server_testutil import TOKEN, call

pytestmark = pytest.mark.slow  # real training runs

CONST = 0.123  # no parity score is this, so the swapped reward is unmistakable
COMMON = ["trainer.val_every=0", "trainer.export=none", "algo.kl_coef=0", "algo.kl_ctrl=fixed"]


def _lines(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def _scored(out: str) -> dict:
    if not os.path.isfile(os.path.join(out, "metrics.jsonl")):
        return {}
    return {m["step"]: m for m in read_metrics(out) if "rollout/score/mean" in m}


class Live:
    """A training run in the background, with the server's URL once it is up."""

    def __init__(self, tmp, out: str, overrides: list, nproc: int = 1):
        self.out, self.log = out, str(tmp / f"{os.path.basename(out)}.{time.monotonic_ns()}.log")
        launcher = [sys.executable] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
        args = [*launcher, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, ["server.enabled=true"], overrides)]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=base_env(VERL_DS_SERVER_TOKEN=TOKEN), stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        url_file = os.path.join(out, "server_url.txt")
        self.url = self.wait(lambda: os.path.isfile(url_file) and open(url_file).read().strip(), "the server URL")

    def wait(self, predicate, what: str, timeout: float = 300.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before {what}:\n{self.tail()}")
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"timed out waiting for {what}:\n{self.tail()}")

    def tail(self) -> str:
        return open(self.log, errors="replace").read()[-6000:]

    def audit_at(self, step: int, key: str) -> dict:
        path = os.path.join(self.out, "state_changes.jsonl")
        return self.wait(lambda: next((a for a in _lines(path) if a["step"] == step and a["key"] == key), None),
                         f"the audit line of {key} at step {step}")


def test_requests_that_were_accepted_then_fatal_are_400_or_rolled_back_and_the_run_goes_on(tmp_path):
    (tmp_path / "none.py").write_text("def score(prompts, responses, batch):\n    return None\n")
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n\ndef score(prompts, responses, batch):\n"
                                       "    return [0.0] * len(responses)\n")
    (tmp_path / "seq.py").write_text("def score(prompts, responses, batch):\n    return [1.0] * len(responses)\n")
    (tmp_path / "const.py").write_text(f"def const(prompts, responses, batch):\n    return [{CONST}] * len(responses)\n")
    out = str(tmp_path / "run")
    run = Live(tmp_path, out, [*COMMON, "trainer.total_steps=400", "trainer.save_every=0",
                               "server.allow_reward_code=true"])
    try:
        run.wait(lambda: _scored(out), "step 1 was logged")
        swap = "/v1/models/reward"
        refused = {  # item -> (route, body, what the 400 says)
            "6: weight 1e300": (swap, {"functions": [{"name": "parity", "weight": 1e300}]}, "is out of range"),
            "6: weight 1e39": (swap, {"functions": [{"name": "parity", "weight": 1e39}]}, "is out of range"),
            "7: exact_match": (swap, {"function": "exact_match"}, "64 of 64 rows of"),
            "7: math_verify": (swap, {"function": "math_verify"}, "64 of 64 rows of"),
            "8: shipped per_token": (swap, {"functions": [{"name": "parity", "per_token": True}]},
                                     "scores whole sequences"),
            "9: KL without a reference": ("/v1/state", {"kl_coef": 0.1, "use_kl_penalty": True},
                                          "this run has no reference model"),
            "9: kl_coef alone": ("/v1/state", {"kl_coef": 0.1}, "this run has no reference model"),
        }
        for item, (route, body, message) in refused.items():
            a = call(run.url, "PATCH" if route == "/v1/state" else "POST", route, body, token=TOKEN)
            assert a.status == 400 and message in a.json["error"], (item, a)
        rolled_back = {  # item -> (body, what the audit line's reason says)
            "8: per_token on a per-sequence function": ({"functions": [{"name": f"{tmp_path}/seq.py:score",
                                                                        "per_token": True}]}, "per-token row has"),
            "10: returns None": ({"function": f"{tmp_path}/none.py:score"}, "returned NoneType"),
            "10: SystemExit at import": ({"function": f"{tmp_path}/exits.py:score"}, "SystemExit: 3"),
        }
        for item, (body, reason) in rolled_back.items():
            a = call(run.url, "POST", swap, body, token=TOKEN)
            assert a.status == 202, (item, a)
            line = run.audit_at(a.json["applies_at_step"], "reward")
            assert line["new"] is None and reason in line["refused"], (item, line)
        good = call(run.url, "POST", swap, {"function": f"{tmp_path}/const.py:const"}, token=TOKEN)
        assert good.status == 202, good
        at = good.json["applies_at_step"]
        assert run.audit_at(at, "reward")["new"].endswith("const.py:const")
        run.wait(lambda: at in _scored(out), f"step {at} was logged")
        assert run.proc.poll() is None  # alive after all of it
        run.proc.send_signal(signal.SIGTERM)  # stop cleanly: checkpoint, exit 75
        assert run.proc.wait(timeout=300) == 75, run.tail()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    steps = _scored(out)
    assert abs(steps[at]["rollout/score/mean"] - CONST) < 1e-6 and steps[at]["state/reward_version"] == 1.0
    assert all(m["state/reward_version"] == 0.0 and abs(m["rollout/score/mean"] - CONST) > 1e-3
               for s, m in steps.items() if s < at)  # nothing refused or rolled back ever scored a step
    audit = _lines(os.path.join(out, "state_changes.jsonl"))
    assert [a["key"] for a in audit] == ["reward"] * 4 and [bool(a.get("refused")) for a in audit] == [True] * 3 + [False]
    assert sorted(j["id"] for j in _lines(os.path.join(out, "staged_changes.jsonl"))) == sorted(a["id"] for a in audit)


def test_a_swap_that_fails_on_one_rank_only_is_rolled_back_on_both(tmp_path):
    """Two ranks: a module that exits at import on rank 1 only, then a function that returns None on rank 1 only
    (it builds everywhere and fails the trial there): each is refused on both ranks at its boundary (no rank waits
    for the other), audited once, and a good swap after them scores every sample on both ranks."""
    (tmp_path / "exit1.py").write_text("import os\nif os.environ.get('RANK') == '1':\n    raise SystemExit(3)\n\n"
                                       "def score(prompts, responses, batch):\n    return [0.0] * len(responses)\n")
    (tmp_path / "none1.py").write_text("import os\n\ndef score(prompts, responses, batch):\n"
                                       "    return None if os.environ.get('RANK') == '1' else [0.0] * len(responses)\n")
    (tmp_path / "const.py").write_text(f"def const(prompts, responses, batch):\n    return [{CONST}] * len(responses)\n")
    out = str(tmp_path / "run")
    run = Live(tmp_path, out, [*COMMON, "trainer.total_steps=400", "trainer.save_every=0",
                               "server.allow_reward_code=true"], nproc=2)
    try:
        run.wait(lambda: _scored(out), "step 1 was logged")
        for name, reason in (("exit1.py", "rank 1: SystemExit: 3"), ("none1.py", "rank 1: RewardFunctionError: ")):
            a = call(run.url, "POST", "/v1/models/reward", {"function": f"{tmp_path}/{name}:score"}, token=TOKEN)
            assert a.status == 202, a
            line = run.audit_at(a.json["applies_at_step"], "reward")
            assert line["refused"].startswith(reason) and "rank 0" not in line["refused"], line
        good = call(run.url, "POST", "/v1/models/reward", {"function": f"{tmp_path}/const.py:const"}, token=TOKEN)
        at = good.json["applies_at_step"]
        run.wait(lambda: at in _scored(out), f"step {at} was logged")
        run.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
        run.proc.wait(timeout=300)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
    steps = _scored(out)
    assert abs(steps[at]["rollout/score/mean"] - CONST) < 1e-6, steps[at]  # the mean over both ranks' samples
    assert all(m["state/reward_version"] == 0.0 for s, m in steps.items() if s < at)
    audit = _lines(os.path.join(out, "state_changes.jsonl"))
    assert [(a["key"], bool(a.get("refused"))) for a in audit] == [("reward", True), ("reward", True), ("reward", False)]


def test_a_replayed_swap_that_failed_is_refused_on_resume_instead_of_killing_the_run_again(tmp_path):
    """The crash loop: a run audited a swap with weight 1e300 (finite in float64, accepted before this fix) at step 3
    and died of NonFiniteError. Resumed from step 2 it replayed the swap, died again after falling back to step 1 and
    replaying it once more; now the replayed swap is re-validated, refused, audited with "replayed": true, and the
    run goes on (a replayed PATCH that fails is tested in test_step_boundary.py)."""
    out = str(tmp_path / "run")
    common = [*COMMON, "trainer.save_every=1", "trainer.keep_last=5", "trainer.max_bad_steps=2"]
    run_train(out, [*common, "trainer.total_steps=2"])
    bad = {"functions": [{"name": "parity", "weight": 1e300, "per_token": False}], "model_path": None,
           "model_weight": None}
    with open(os.path.join(out, "state_changes.jsonl"), "a") as fh:  # what the crashed run audited
        fh.write(json.dumps({"time": 0.0, "step": 3, "key": "reward", "old": "parity", "new": "parity",
                             "client": "127.0.0.1", "spec": bad}) + "\n")
    proc = run_train(out, [*common, "trainer.total_steps=5"], check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "resumed from" in log and "falling back" not in log
    steps = _scored(out)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert all(math.isfinite(m["rollout/score/mean"]) and m["training/nonfinite_steps"] == 0 for m in steps.values())
    assert all(m["state/reward_version"] == 0.0 for m in steps.values())
    replayed = [a for a in _lines(os.path.join(out, "state_changes.jsonl")) if a.get("replayed")]
    assert [(a["step"], a["key"], a["new"]) for a in replayed] == [(3, "reward", None)]
    assert "1e+300 is out of range [-1e+06, 1e+06]" in replayed[0]["refused"]


def test_a_change_answered_202_and_lost_in_a_crash_before_its_step_is_applied_after_the_resume(tmp_path):
    """The reward holds step K open (the run is at global_step K); a PATCH and a swap are answered 202 for step K + 1,
    then the job is SIGKILLed. The resumed run (from checkpoint K - 1) applies both at step K + 1, with audit lines."""
    hold, held = tmp_path / "HOLD", tmp_path / "HELD"
    (tmp_path / "gate.py").write_text(
        "import os, time\n\n"
        "def score(prompts, responses, batch):\n"
        f"    if os.path.exists({str(hold)!r}):\n"
        f"        open({str(held)!r}, 'w').close()\n"
        f"        while os.path.exists({str(hold)!r}):\n"
        "            time.sleep(0.05)\n"
        "    return [float(len(r) % 2) for r in responses]\n")
    (tmp_path / "const.py").write_text(f"def const(prompts, responses, batch):\n    return [{CONST}] * len(responses)\n")
    out = str(tmp_path / "run")
    overrides = [*COMMON, "trainer.total_steps=6", "trainer.save_every=1", f"reward.functions=['{tmp_path}/gate.py:score']",
                 f"server.swappable_rewards=['{tmp_path}/const.py:const']"]
    run = Live(tmp_path, out, overrides)
    try:
        run.wait(lambda: 2 in _scored(out), "step 2 was logged")
        hold.touch()
        run.wait(held.exists, "the reward held a step open")
        patch = call(run.url, "PATCH", "/v1/state", {"temperature": 0.5}, token=TOKEN)
        swap = call(run.url, "POST", "/v1/models/reward", {"function": f"{tmp_path}/const.py:const"}, token=TOKEN)
        assert patch.status == 202 and swap.status == 202, (patch, swap)
        at = patch.json["applies_at_step"]
        assert swap.json["applies_at_step"] == at and 3 < at <= 6, (patch, swap)
        run.proc.kill()  # the crash, at step at - 1
        run.proc.wait()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    assert _lines(os.path.join(out, "state_changes.jsonl")) == []  # nothing audited: only the journal has them
    hold.unlink()
    resumed = run_train(out, [*overrides, "server.enabled=false"])
    assert f"(step {at - 2})" in resumed.stdout + resumed.stderr  # resumed from the checkpoint before the crash
    steps = _scored(out)
    assert sorted(steps) == list(range(1, 7))
    for s, m in steps.items():
        after = s >= at
        assert m["state/temperature"] == (0.5 if after else 1.0), (s, at)
        assert (abs(m["rollout/score/mean"] - CONST) < 1e-6) == after, (s, at)
    audit = _lines(os.path.join(out, "state_changes.jsonl"))
    assert [(a["step"], a["key"], a.get("replayed")) for a in audit] == \
        [(at, "temperature", True), (at, "reward", True)]
