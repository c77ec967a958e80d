"""rollout.mode one_step_off / streaming on real 2-rank jobs (gloo, ZeRO-3 on CPU): max_staleness 0 is the
synchronous run bit for bit (and resumes bit for bit), SIGUSR1 checkpoints the queue and the resumed run trains
the saved samples next, and a generation thread that raises or hangs stops every rank with a message naming it."""
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "reliability"))
from e2e_utils import read_metrics, run_train  # noqa: E402
from reliability_testutil import launch, metric_steps  # noqa: E402
from resume_testutil import GRPO, SYNC_GRPO  # noqa: E402
from verl_ds import safe_state  # noqa: E402

pytestmark = pytest.mark.slow  # real training runs / several processes

# wall-clock measurements differ between any two runs; everything else must not
CLOCK = ("timing_s/", "perf/throughput", "async/", "time/")


def _trained(rows: list) -> dict:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in rows
            if "training/global_step" in r}


def test_max_staleness_0_is_the_synchronous_run_bit_for_bit_and_resumes_exactly(tmp_path, sync_grpo_run):
    common = SYNC_GRPO  # sync_grpo_run: this job on 2 ranks, synchronous
    sync, s0, part = sync_grpo_run, *(str(tmp_path / n) for n in ("s0", "part"))
    run_train(s0, [*common, "rollout.mode=streaming"], nproc=2, timeout=900)
    expected, got = _trained(read_metrics(sync)), _trained(read_metrics(s0))
    assert sorted(expected) == [1, 2, 3, 4]
    assert got == expected  # every loss, score, length, grad norm and KL: equal floats
    # 2 steps, then a resume to 4: steps 3 and 4 are the uninterrupted run's
    run_train(part, [*common, "rollout.mode=streaming", "trainer.total_steps=2"], nproc=2, timeout=900)
    run_train(part, [*common, "rollout.mode=streaming", "trainer.resume=auto"], nproc=2, timeout=900)
    resumed = _trained(read_metrics(part))
    assert {s: resumed[s] for s in (3, 4)} == {s: expected[s] for s in (3, 4)}


def test_usr1_checkpoints_the_queue_and_the_resumed_run_trains_the_saved_samples_next(tmp_path):
    out = str(tmp_path / "run")
    stream = [*GRPO, "rollout.mode=streaming", "rollout.max_staleness=2", "rollout.is_correction=true",
              "rollout.is_mode=decoupled", "rollout.max_new_tokens=12"]
    job = launch(out, [*stream, "trainer.total_steps=200"], log_name="usr1")
    job.wait_for(lambda: 2 in metric_steps(out), 900, "step 2 in metrics.jsonl")
    job.signal(0, signal.SIGUSR1)
    assert job.wait(600) == [75, 75], job.tail()
    ckpts = os.path.join(out, "checkpoints")
    s = int(open(os.path.join(ckpts, "latest")).read().split("_")[-1])
    state = safe_state.load(os.path.join(ckpts, f"global_step_{s}", "trainer_state.json"))["async"]
    assert state["mode"] == "streaming" and state["world_size"] == 2 and len(state["ranks"]) == 2
    per_rank = 2  # rollout.batch_size 4 over 2 ranks
    for rank in state["ranks"]:
        for g in rank["queue"]:  # each queued group: its samples, its prompt and each token's version
            v = g["versions"]
            # the checkpointed weights (after step s's update) are version s + 1: a group drawn after that
            # update has every token at s + 1
            assert v.shape == g["fields"]["action"].shape and int(v[v >= 0].min()) <= s + 1
        assert len(rank["queue"]) + len(rank["inflight"]) >= per_rank, "the generation thread ran ahead"
    # the resumed step trains the saved samples first: where a rank had a whole batch queued, its response
    # lengths are those of the saved groups (averaged over the 2 ranks, as the metric is)
    job = launch(out, [*stream, f"trainer.total_steps={s + 1}"], log_name="resume")
    assert job.wait(900) == [0, 0], job.tail()
    row = _trained(read_metrics(out))[s + 1]
    if all(len(r["queue"]) >= per_rank for r in state["ranks"]):
        means = [sum(float(g["fields"]["response_length"].float().mean()) for g in r["queue"][:per_rank]) / per_rank
                 for r in state["ranks"]]
        assert row["response_length/mean"] == pytest.approx(sum(means) / 2, rel=1e-6)
    assert f"resumed from {os.path.join(ckpts, f'global_step_{s}')}" in job.text(0)


FAULTY = '''
import os, threading, time

def score(prompts, responses, batch):
    if os.environ["RANK"] == "1" and threading.current_thread() is not threading.main_thread():
        if os.environ["FAULT"] == "raise":
            raise RuntimeError("reward server unreachable")
        time.sleep(3600)
    return [0.0] * len(responses)
'''


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failing_or_hung_generation_thread_stops_every_rank_naming_it(tmp_path, fault, monkeypatch):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    monkeypatch.setenv("FAULT", fault)
    out = str(tmp_path / "run")
    timeout_s = 40
    job = launch(out, [*GRPO, "rollout.mode=one_step_off", f"reward.functions=[{path}:score]",
                       f"trainer.dist_timeout_s={timeout_s}", "trainer.total_steps=3"], log_name=fault)
    t0 = time.monotonic()
    codes = job.wait(900)
    assert all(c not in (0, None) for c in codes), job.tail()
    for rank in (0, 1):
        text = job.text(rank)
        assert "rank 1: ProducerError: rank 1:" in text, job.tail()
        # a hung thread: the trainer's wait for samples or for the weights gives up after half the timeout
        want = "RuntimeError: reward server unreachable" if fault == "raise" else \
            f"{timeout_s // 2} s (half of trainer.dist_timeout_s); it hangs"
        assert want in text, job.tail()
    if fault == "hang":  # start-up included; the wait itself is half the timeout
        assert time.monotonic() - t0 < 600


def test_a_failed_trainer_stops_the_split_generation_rank_with_its_failure_status(tmp_path):
    # the logits turn non-finite on the training rank at step 2: both ranks exit 1, so a launcher that reads each
    # task's status (srun, a per-rank wrapper) sees the job failed from every rank (the generation rank exited 0)
    out = str(tmp_path / "run")
    job = launch(out, [*GRPO, "rollout.mode=one_step_off", "rollout.split_ranks=1", "trainer.total_steps=4",
                       "trainer.max_bad_steps=1"],
                 fault="nan_logits_at_step=2:phase=update", log_name="split_nan")
    assert job.wait(900) == [1, 1], job.tail()
    assert "NonFiniteError" in job.text(0), job.tail()
    assert "the training ranks stopped with exit code 1; generation rank 1 exits with it" in job.text(1), job.tail()
