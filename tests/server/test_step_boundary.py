"""The step boundary's journal, rollback and replay (issue 31, items 10-12) on a real SharedState, real reward
models built from real files, and the real audit and journal files; one rank (the collectives are identities)."""
import json
import os

import pytest

from verl_ds.step_boundary import AUDIT_FILE, JOURNAL_FILE, StepBoundary
from verl_ds.models import RewardModel
from verl_ds.reward_spec import parse_reward_swap
from verl_ds.rewards import resolve_reward_fn
from verl_ds.state import SharedState


def _lines(run, name):
    path = os.path.join(run, name)
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


class Run:
    """A StepBoundary wired as the trainer wires it, with a probe that scores two canned samples."""

    def __init__(self, run_dir):
        self.state = SharedState(rank=0)
        self.state.set("reward_name", "parity")
        self.active = None
        self.boundary = StepBoundary(self.state, str(run_dir), build_reward=self.build, install=self.install,
                                     reward_spec=parse_reward_swap({"function": "parity"}), check_swap=parse_reward_swap,
                                     probe=self.probe)

    @staticmethod
    def build(spec):
        reward = RewardModel()
        for f in spec["functions"]:
            reward.register_reward_fn(resolve_reward_fn(f["name"]), name=f["name"].rpartition(":")[2],
                                      weight=f["weight"], per_token=f["per_token"])
        return reward

    def install(self, reward):
        self.active = reward

    @staticmethod
    def probe(reward):
        for name, fn, per_token in reward.functions():
            out = fn(["odd : 1 =>", "even : 2 =>"], ["odd", "even"], None)
            if per_token and not all(isinstance(row, (list, tuple)) for row in out):
                raise ValueError(f"{name}: per-token reward returned {out!r}")
            if out is None or len(out) != 2:
                raise ValueError(f"{name}: returned {out!r}")


@pytest.fixture
def code(tmp_path):
    """Reward modules that used to kill the run at the boundary."""
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\ndef score(p, r, b):\n    return [0.0] * len(r)\n")
    (tmp_path / "none.py").write_text("def score(p, r, b):\n    return None\n")
    (tmp_path / "seq.py").write_text("def score(p, r, b):\n    return [1.0] * len(r)\n")
    return tmp_path


def test_a_swap_that_raises_systemexit_or_scores_nothing_is_rolled_back_and_audited(tmp_path, code):
    run = Run(tmp_path)
    for spec in ({"function": f"{code}/exits.py:score"}, {"function": f"{code}/none.py:score"},
                 {"functions": [{"name": f"{code}/seq.py:score", "per_token": True}]}):
        assert run.boundary.stage_reward_swap(spec, client="c")["applies_at_step"] == run.state.get("global_step") + 1
        run.boundary.cross()  # before the fix: SystemExit ended the process here
    assert run.active is None and run.state.get("reward_name") == "parity" and run.state.get("reward_version") == 0
    audit = _lines(tmp_path, AUDIT_FILE)
    assert [(a["step"], a["key"], a["new"]) for a in audit] == [(1, "reward", None), (2, "reward", None),
                                                                (3, "reward", None)]
    assert audit[0]["refused"] == "rank 0: SystemExit: 3"
    assert audit[1]["refused"] == "rank 0: ValueError: score: returned None"
    assert "per-token reward returned [1.0, 1.0]" in audit[2]["refused"]
    journal = _lines(tmp_path, JOURNAL_FILE)
    assert [j["id"] for j in journal] == [a["id"] for a in audit]  # each accepted change is settled by its audit line
    run.boundary.stage_reward_swap({"function": f"{code}/seq.py:score"})
    run.boundary.cross()  # the run goes on, and a good swap still takes
    assert run.state.get("reward_name") == f"{code}/seq.py:score" and run.active.reward_fns()[0]["name"] == "score"


def test_a_staged_change_is_journaled_then_applied_after_a_crash_or_audited_as_dropped(tmp_path):
    run = Run(tmp_path)
    for _ in range(3):
        run.boundary.cross()
    a = run.state.stage({"temperature": 0.5}, client="alice")  # answered 202 for step 4 ...
    run.boundary.stage_reward_swap({"function": "format"}, client="bob")
    assert a["applies_at_step"] == 4
    assert _lines(tmp_path, AUDIT_FILE) == []  # ... and the job dies before step 4: only the journal has them
    journal = _lines(tmp_path, JOURNAL_FILE)
    assert [(j["step"], j["key"], j.get("new")) for j in journal] == [(4, "temperature", 0.5), (4, "reward", None)]

    resumed = Run(tmp_path)  # resumed from a checkpoint at step 2
    resumed.state.set("global_step", 2)
    assert resumed.boundary.schedule_replay(2) == 2
    resumed.boundary.cross()
    assert resumed.state.get("temperature") == 1.0 and _lines(tmp_path, AUDIT_FILE) == []
    resumed.boundary.cross()  # step 4: both apply, at the step announced to their clients
    assert resumed.state.get("temperature") == 0.5 and resumed.state.get("reward_name") == "format"
    audit = _lines(tmp_path, AUDIT_FILE)
    assert [(r["step"], r["key"], r["new"], r["client"], r["replayed"], r["id"]) for r in audit] == \
        [(4, "temperature", 0.5, "alice", True, journal[0]["id"]), (4, "reward", "format", "bob", True, journal[1]["id"])]

    late = Run(tmp_path)  # resumed from a checkpoint past step 4 that never saw them (a journal from elsewhere)
    with open(os.path.join(tmp_path, JOURNAL_FILE), "a") as fh:
        fh.write(json.dumps({"id": "lost1", "step": 3, "key": "top_k", "new": 5, "client": "carol"}) + "\n")
    assert late.boundary.schedule_replay(4) == 0
    dropped = _lines(tmp_path, AUDIT_FILE)[-1]
    assert (dropped["id"], dropped["step"], dropped["key"], dropped["new"]) == ("lost1", 3, "top_k", 5)
    assert dropped["dropped"].startswith("staged for step 3, which the run passed without applying it")


def test_changes_still_staged_at_the_end_and_a_replaced_swap_are_audited_as_dropped(tmp_path):
    run = Run(tmp_path)
    run.boundary.cross()
    run.state.stage({"top_k": 7})
    run.boundary.stage_reward_swap({"function": "format"}, client="x")
    run.boundary.stage_reward_swap({"function": "parity"}, client="y")  # replaces the first
    run.boundary.close(completed=True)
    audit = _lines(tmp_path, AUDIT_FILE)
    assert [(r["step"], r["key"], r["client"]) for r in audit] == [(2, "reward", "x"), (2, "top_k", ""),
                                                                   (2, "reward", "y")]
    assert audit[0]["dropped"].startswith("replaced by the swap")
    assert all(r["dropped"].startswith("the run ended at step 1") for r in audit[1:])
    assert {r["id"] for r in audit} == {j["id"] for j in _lines(tmp_path, JOURNAL_FILE)}


def test_a_replayed_change_that_fails_is_refused_audited_and_never_tried_again(tmp_path):
    """An audit log written before the float32 weight check: a swap with weight 1e300 and a PATCH outside today's
    range, applied at step 3. Resumed from step 2 they are refused once, audited, and not replayed again."""
    bad_swap = {"functions": [{"name": "parity", "weight": 1e300, "per_token": False}], "model_path": None,
                "model_weight": None}
    with open(os.path.join(tmp_path, AUDIT_FILE), "w") as fh:
        fh.write(json.dumps({"time": 0, "step": 3, "key": "reward", "old": "parity", "new": "parity", "client": "",
                             "spec": bad_swap}) + "\n")
        fh.write(json.dumps({"time": 0, "step": 3, "key": "temperature", "old": 1.0, "new": 1e-38,
                             "client": ""}) + "\n")
    for attempt in range(2):
        run = Run(tmp_path)
        run.state.set("global_step", 2)
        planned = run.boundary.schedule_replay(2)
        run.boundary.cross()
        assert run.active is None and run.state.get("temperature") == 1.0
        assert planned == (2 if attempt == 0 else 0)
    audit = _lines(tmp_path, AUDIT_FILE)[2:]
    assert [(r["step"], r["key"], r["replayed"]) for r in audit] == [(3, "temperature", True), (3, "reward", True)]
    assert "1e+300 is out of range [-1e+06, 1e+06]" in audit[1]["refused"]
    assert "temperature" in audit[0]["refused"] and "out of range" in audit[0]["refused"]


def test_a_fall_back_resume_in_the_same_process_does_not_replay_what_is_still_queued(tmp_path):
    run = Run(tmp_path)
    for _ in range(3):
        run.boundary.cross()
    run.state.stage({"top_k": 3})
    run.boundary.stage_reward_swap({"function": "format"})
    run.state.set("global_step", 1)  # fell back to a checkpoint at step 1
    assert run.boundary.schedule_replay(1) == 0  # the queue applies them at the next boundary, once
    for _ in range(4):
        run.boundary.cross()
    assert [(a["step"], a["key"]) for a in _lines(tmp_path, AUDIT_FILE)] == [(2, "top_k"), (2, "reward")]
