"""Real faults on one real 2-rank job, one after another on the same run directory; every link resumes from
what the previous one left. The tests run in file order and share the run (a failed link skips the rest).

  1 SIGTERM to rank 1 only        both ranks finish the step, checkpoint, exit 75
  2 SIGKILL rank 1 inside a save  (after_actor) rank 0 exits with RankFailure; timed
  3-5 SIGKILL inside a save       after_critic, before_manifest, before_latest: resume from the previous complete one
  6 rank 1 hangs (SIGSTOP)        rank 0 exits after trainer.dist_timeout_s with RankFailure; timed
  7 NaN logits on rank 1          steps skipped on both ranks, forensic records, stop after max_bad_steps
  8 corrupt newest checkpoint     skipped with a message; the job finishes; every step logged exactly once

Figures (steps lost per fault, exit times) are printed (pytest -s) and written to <run>/../figures.json.
"""
import json
import os
import re
import signal
import time

import pytest

from reliability_testutil import launch, metric_steps
from verl_ds.checkpoint import find_resumable, verify

pytestmark = pytest.mark.slow  # real training runs / several processes

COMMON = ["trainer.save_every=1", "trainer.keep_last=3", "trainer.total_steps=30"]
START_TIMEOUT = 900  # start-up on a loaded 2-core machine can take minutes


class Chain:
    def __init__(self, root):
        self.root = str(root)
        self.out = os.path.join(self.root, "run")
        self.ckpts = os.path.join(self.out, "checkpoints")
        self.broken = False
        self.s = None  # the step of the preemption checkpoint
        self.figures = {"faults": [], "rank_failure_exit_s": {}}

    def step_dir(self, step: int) -> str:
        return os.path.join(self.ckpts, f"global_step_{step}")

    def record(self, fault: str, last_done: int, resumed_next: int, survived: bool = True, **extra):
        self.figures["faults"].append({"fault": fault, "last_step_done": last_done, "resumed_from": resumed_next,
                                       "steps_lost": last_done - resumed_next, "survived": survived, **extra})
        with open(os.path.join(self.root, "figures.json"), "w") as fh:
            json.dump(self.figures, fh, indent=1)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    c = Chain(tmp_path_factory.mktemp("faults"))
    yield c
    print("\nreliability figures:", json.dumps(c.figures, indent=1))


def _resumed_from(text: str):
    m = re.search(r"resumed from \S*global_step_(\d+)", text)
    return int(m.group(1)) if m else None


def _last_logged(out: str) -> int:
    steps = metric_steps(out)
    return max(steps) if steps else 0


def _run_link(c: Chain, name: str, fault: str, overrides=(), timeout=START_TIMEOUT):
    job = launch(c.out, [*COMMON, *overrides], fault=fault, log_name=name)
    codes = job.wait(timeout)
    return job, codes


def test_1_sigterm_to_one_rank_checkpoints_and_exits_75(chain):
    c = chain
    c.broken = True  # cleared at the end of each link that passes
    job = launch(c.out, COMMON, log_name="1_sigterm")
    job.wait_for(lambda: 1 in metric_steps(c.out), START_TIMEOUT, "step 1 in metrics.jsonl")
    job.signal(1, signal.SIGTERM)  # Slurm signals every task; one rank alone is the harder case
    sent = time.monotonic()
    codes = job.wait(600)
    assert codes == [75, 75], job.tail()
    c.s = s = int(open(os.path.join(c.ckpts, "latest")).read().split("_")[-1])
    assert s >= 1 and verify(c.step_dir(s)) is None
    assert metric_steps(c.out) == list(range(1, s + 1))  # the step in flight finished and was logged, once
    assert "SIGTERM received: stopped after step" in job.text(1)
    assert f"stopped after step {s}, checkpoint {c.step_dir(s)}" in job.text(0)
    c.figures["sigterm_to_exit_s"] = round(max(job.exit_times.values()) - sent, 1)
    c.record("SIGTERM (preemption)", last_done=s, resumed_next=s)
    c.broken = False


def _kill_in_save(c: Chain, point: str, rank=None):
    s = c.s
    rank_opt = f":rank={rank}" if rank is not None else ""
    job, codes = _run_link(c, f"kill_{point}", f"kill_at={point}:step={s + 1}{rank_opt}")
    text = job.tail(20000)
    assert _resumed_from(job.text(0)) == s, text
    assert -signal.SIGKILL in codes and all(code != 0 for code in codes), (codes, text)
    assert find_resumable(c.ckpts) == c.step_dir(s)
    reason = verify(c.step_dir(s + 1))
    if point == "before_latest":
        assert reason is None and open(os.path.join(c.ckpts, "latest")).read() == f"global_step_{s}"
    else:
        assert reason is not None
    return job, codes


def test_2_sigkill_one_rank_during_a_save(chain):
    c = chain
    if c.broken:
        pytest.skip("an earlier link failed")
    c.broken = True
    job, codes = _kill_in_save(c, "after_actor", rank=1)
    assert codes[1] == -signal.SIGKILL and codes[0] not in (0, -signal.SIGKILL)
    rank0 = job.text(0)
    assert "a collective failed because another rank died or stopped answering" in rank0
    assert f"Last complete checkpoint: {c.step_dir(c.s)}" in rank0
    c.figures["rank_failure_exit_s"]["rank killed"] = round(job.exit_times[0] - job.exit_times[1], 1)
    c.record("SIGKILL rank 1 in a save (after_actor)", last_done=c.s + 1, resumed_next=c.s)
    c.broken = False


@pytest.mark.parametrize("point", ["after_critic", "before_manifest", "before_latest"])
def test_3_sigkill_during_a_save_resumes_from_the_previous_complete_checkpoint(chain, point):
    c = chain
    if c.broken:
        pytest.skip("an earlier link failed")
    c.broken = True
    job, _ = _kill_in_save(c, point)
    # the previous link's leftover global_step_<s+1> was named at start-up (then replaced by this run's save)
    assert f"skipping checkpoint {c.step_dir(c.s + 1)}: no COMPLETE manifest" in job.text(0), job.text(0)[-3000:]
    c.record(f"SIGKILL in a save ({point})", last_done=c.s + 1, resumed_next=c.s)
    c.broken = False


def test_4_a_hung_rank_makes_the_other_exit_after_the_timeout(chain):
    c = chain
    if c.broken:
        pytest.skip("an earlier link failed")
    c.broken = True
    s, timeout_s = c.s, 15
    job = launch(c.out, [*COMMON, f"trainer.dist_timeout_s={timeout_s}"],
                 fault=f"hang_at=step_begin:step={s + 1}:rank=1", log_name="hang")
    try:
        job.wait_for(lambda: "injected fault: hang" in job.text(1), START_TIMEOUT, "rank 1 to hang")
        hung = time.monotonic()
        deadline = hung + timeout_s + 300
        while job.procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = time.monotonic()
        assert job.procs[0].poll() not in (None, 0), job.tail()
    finally:
        job.kill()  # rank 1 is stopped; SIGKILL ends it
    assert f"stopped answering for trainer.dist_timeout_s={timeout_s} s" in job.text(0)
    assert f"skipping checkpoint {c.step_dir(s + 1)}: complete, but 'latest' was not updated" in job.text(0)
    assert _resumed_from(job.text(0)) == s
    c.figures["rank_failure_exit_s"][f"rank hung (dist_timeout_s={timeout_s})"] = round(exited - hung, 1)
    c.record("rank 1 hangs (SIGSTOP)", last_done=s, resumed_next=s)
    c.broken = False


def test_5_nan_logits_skip_updates_on_every_rank_then_stop_after_max_bad_steps(chain):
    c = chain
    if c.broken:
        pytest.skip("an earlier link failed")
    c.broken = True
    s = c.s
    fault = (f"nan_logits_at_step={s + 1}:rank=1;nan_logits_at_step={s + 3}:rank=1:phase=update;"
             f"nan_logits_at_step={s + 5}-{s + 9}:rank=1")
    job, codes = _run_link(c, "nan", fault, ["trainer.max_bad_steps=2"])
    record = os.path.join(c.out, "nonfinite", f"step_{s + 6}.json")
    for r in (0, 1):  # both ranks stop at the same step, naming the record
        assert codes[r] == 1, job.tail()
        assert f"2 consecutive steps with non-finite values (trainer.max_bad_steps=2)" in job.text(r)
        assert f"Last forensic record: {record}" in job.text(r)
    rows = {m["step"]: m for m in map(json.loads, open(os.path.join(c.out, "metrics.jsonl"))) if m["step"] > s}
    assert sorted(rows) == list(range(s + 1, s + 7))
    assert [rows[st]["training/consecutive_bad_steps"] for st in sorted(rows)] == [1, 0, 1, 0, 1, 2]
    assert [rows[st]["training/nonfinite_steps"] for st in sorted(rows)] == [1, 1, 2, 2, 3, 4]
    assert rows[s + 1]["training/skipped_updates"] == 4  # 2 mini-batches x (critic + actor): the whole update
    assert rows[s + 3]["training/skipped_updates"] >= 1
    for st in (s + 2, s + 4):  # the steps after a skipped one train normally: the parameters stayed finite
        assert rows[st]["training/skipped_updates"] == 0
        for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
            assert isinstance(rows[st][k], float) and rows[st][k] == rows[st][k], (st, k, rows[st][k])

    rollout = json.load(open(os.path.join(c.out, "nonfinite", f"step_{s + 1}.json")))
    assert rollout["kind"] == "batch" and rollout["origin"] == "old_log_probs" and rollout["world_size"] == 2
    first = rollout["samples"][0]
    assert (first["rank"], first["index"], first["nonfinite"]["old_log_probs"]) == (1, 0, [0])
    assert isinstance(first["score"], float) and first["prompt"] and "response" in first
    assert rollout["fields"]["old_log_probs"] == {"samples": 1, "tokens": 1}
    update = json.load(open(os.path.join(c.out, "nonfinite", f"step_{s + 3}.json")))
    assert update["kind"] == "update" and update["fields"] == {}
    events = [e for e in update["update_events"] if e["role"] == "actor"]
    assert {e["rank"] for e in events} == {0, 1} and all(e["skipped"] for e in events)
    assert any(e["nonfinite_losses"] for e in events if e["rank"] == 1)
    assert os.path.isfile(record)
    # the stopping step is saved before the run ends (its updates were skipped: the weights are the finite ones)
    assert find_resumable(c.ckpts) == c.step_dir(s + 6)
    assert "the run is ending on a fault at step" in job.text(0)
    c.figures["nan"] = {"bad_steps": 4, "skipped_updates": sum(rows[st]["training/skipped_updates"] for st in rows)}
    c.record("NaN logits, then max_bad_steps", last_done=s + 6, resumed_next=s + 6, survived=True,
             note="3 bad steps skipped in place; the job stopped on the 2nd consecutive one as configured")
    c.broken = False


def test_6_corrupt_newest_checkpoint_is_skipped_and_the_job_finishes(chain):
    c = chain
    if c.broken:
        pytest.skip("an earlier link failed")
    c.broken = True
    s = c.s
    newest = c.step_dir(s + 6)
    assert find_resumable(c.ckpts) == newest
    victim = max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(newest, "actor")) for f in fs),
                 key=os.path.getsize)
    with open(victim, "r+b") as fh:  # a torn write: the file lost its tail
        fh.truncate(os.path.getsize(victim) // 2)
    job, codes = _run_link(c, "final", "", [f"trainer.total_steps={s + 7}"])
    assert codes == [0, 0], job.tail()
    assert f"skipping checkpoint {newest}: file actor/" in job.text(0)
    assert _resumed_from(job.text(0)) == s + 5
    assert metric_steps(c.out) == list(range(1, s + 8))  # every step logged exactly once, none missing
    assert verify(c.step_dir(s + 7)) is None and open(os.path.join(c.ckpts, "latest")).read() == f"global_step_{s + 7}"
    c.record("corrupt newest checkpoint (truncated shard)", last_done=s + 6, resumed_next=s + 5)
    c.figures["faults_injected"] = len(c.figures["faults"])
    c.figures["faults_survived"] = sum(f["survived"] for f in c.figures["faults"])
    c.broken = False
