"""Streaming on split ranks (rollout.split_ranks=1) checkpointed and resumed, real runs (gloo, ZeRO-3 on CPU): the
generation rank's queues, prompts in flight and to redo, samplers and RNG streams travel through the training ranks'
checkpoint in the colocated format, so the resumed steps train the prompts the uninterrupted run trained at those
steps and, where the saved queue held a whole step, its very samples; also at another world size (2 training ranks
to 1) and from a colocated streaming checkpoint; SIGUSR1 to every task checkpoints the queues; with max_staleness 0
two training ranks per generation rank are the synchronous 2-rank run bit for bit, also resumed."""
import os
import signal
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "reliability"))
from e2e_utils import run_train  # noqa: E402
from resume_testutil import GRPO, PER_STEP, SYNC_GRPO, assert_equal_runs, assert_resumed_like_saved, rows  # noqa: E402
from reliability_testutil import launch, metric_steps  # noqa: E402
from verl_ds import safe_state  # noqa: E402

pytestmark = pytest.mark.slow  # real training runs / several processes

SPLIT = ["rollout.split_ranks=1"]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("saved, resumed", [((2, SPLIT), (2, SPLIT)), ((3, SPLIT), (2, SPLIT)), ((1, []), (2, SPLIT)),
                                            ((2, SPLIT), (1, []))],
                         ids=["split-same-world", "split-2-trainers-to-1", "colocated-to-split", "split-to-colocated"])
def test_a_resumed_split_streaming_run_trains_the_saved_queue_and_prompts_next(tmp_path, saved_streaming_run, saved,
                                                                               resumed):
    (saved_nproc, saved_split), (resumed_nproc, resumed_split) = saved, resumed
    saved_trainers = saved_nproc - len(saved_split)
    # one generation rank makes every trainer's batches in turn: two update epochs per step give it the time to
    # queue a whole step for each trainer before the save at step 2 (one epoch left the second trainer's batch
    # in flight at the save in 1 clean-clone CI run of 4)
    epochs = ["actor.ppo_epochs=2"] if saved_split and saved_trainers > 1 else []
    # split-same-world and split-to-colocated resume one saved run, colocated-to-split test_async_resume_world.py's
    first, common = saved_streaming_run(saved_nproc, [*epochs, *saved_split])
    common = [o for o in common if o not in saved_split]
    second = str(tmp_path / "second")
    step_dir = os.path.join(first, "checkpoints", "global_step_2")
    state = safe_state.load(os.path.join(step_dir, "trainer_state.json"))["async"]
    assert state["mode"] == "streaming" and len(state["ranks"]) == saved_trainers
    per_rank = PER_STEP // saved_trainers
    for rank in state["ranks"]:  # the generation rank ran ahead: its queue and prompts in flight are in the checkpoint
        assert len(rank["queue"]) + len(rank["inflight"]) >= per_rank
        for g in rank["queue"]:  # each queued group: its samples, its prompt, each token's version
            v = g["versions"]
            assert v.shape == g["fields"]["action"].shape and 0 <= int(v[v >= 0].min()) <= 3
    proc = run_train(second, [*common, *resumed_split, f"trainer.resume={step_dir}"], nproc=resumed_nproc,
                     timeout=900)
    if saved_trainers != resumed_nproc - len(resumed_split):
        assert "dealt to 1" in proc.stdout + proc.stderr
    assert_resumed_like_saved(first, second, state, per_rank, require_queued=True)


def test_usr1_to_every_task_checkpoints_the_generation_ranks_queues_and_every_rank_exits_75(tmp_path):
    out = str(tmp_path / "run")
    stream = ["algo.adv_estimator=grpo", "rollout.n=2", f"rollout.batch_size={PER_STEP}", "actor.mini_batch_size=8",
              "actor.micro_batch_size=4", "trainer.val_every=0", "rollout.mode=streaming", "rollout.max_staleness=2",
              "rollout.max_new_tokens=12", *SPLIT]
    job = launch(out, [*stream, "trainer.total_steps=200"], nproc=3, log_name="usr1")
    job.wait_for(lambda: 2 in metric_steps(out), 900, "step 2 in metrics.jsonl")
    for rank in range(3):  # as Slurm signals every task of the step, the generation rank included
        job.signal(rank, signal.SIGUSR1)
    assert job.wait(600) == [75, 75, 75], job.tail()
    ckpts = os.path.join(out, "checkpoints")
    s = int(open(os.path.join(ckpts, "latest")).read().split("_")[-1])
    state = safe_state.load(os.path.join(ckpts, f"global_step_{s}", "trainer_state.json"))["async"]
    assert state["mode"] == "streaming" and state["world_size"] == 2 and len(state["ranks"]) == 2
    per_rank = PER_STEP // 2
    for rank in state["ranks"]:
        assert len(rank["queue"]) + len(rank["inflight"]) >= per_rank, "the generation rank ran ahead"
        assert rank["rng"]["torch"].dtype == torch.uint8  # each training rank's stream on the generation rank
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    job = launch(out, [*stream, f"trainer.total_steps={s + 1}"], nproc=3, log_name="resume")
    assert job.wait(900) == [0, 0, 0], job.tail()
    row = rows(out)[s + 1]
    if all(len(r["queue"]) >= per_rank for r in state["ranks"]):  # the resumed step trains the saved samples
        means = [sum(float(g["fields"]["response_length"].float().mean()) for g in r["queue"][:per_rank]) / per_rank
                 for r in state["ranks"]]
        assert row["response_length/mean"] == pytest.approx(sum(means) / 2, rel=1e-6)


CLOCK = ("timing_s/", "perf/throughput", "async/", "time/")  # wall-clock figures, and the async bookkeeping


def _trained(out: str) -> dict:
    return {s: {k: v for k, v in r.items() if not k.startswith(CLOCK)} for s, r in rows(out).items()}


@pytest.mark.timeout(2400)
def test_max_staleness_0_with_two_trainers_per_generation_rank_is_the_synchronous_run_also_after_a_resume(
        tmp_path, sync_grpo_run):
    common = SYNC_GRPO  # sync_grpo_run: this job on 2 ranks, synchronous
    split = ["rollout.mode=streaming", *SPLIT]
    sync, whole, part = sync_grpo_run, *(str(tmp_path / n) for n in ("whole", "part"))
    run_train(whole, [*common, *split], nproc=3, timeout=900)
    expected = _trained(sync)
    assert sorted(expected) == [1, 2, 3, 4]
    assert_equal_runs(_trained(whole), expected)  # each trainer's own RNG stream on the generation rank
    run_train(part, [*common, *split, "trainer.total_steps=2"], nproc=3, timeout=900)
    run_train(part, [*common, *split, "trainer.resume=auto"], nproc=3, timeout=900)
    resumed = _trained(part)
    assert_equal_runs({s: resumed[s] for s in (3, 4)}, {s: expected[s] for s in (3, 4)})  # the streams come back


def test_a_queue_one_step_off_on_split_ranks_cannot_restore_is_refused_naming_the_keys(tmp_path):
    common = [*GRPO, "trainer.save_every=2", "rollout.max_staleness=2"]
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run_train(first, [*common, "rollout.mode=streaming", "trainer.total_steps=2"], nproc=1, timeout=900)
    step_dir = os.path.join(first, "checkpoints", "global_step_2")
    held = safe_state.load(os.path.join(step_dir, "trainer_state.json"))["async"]["ranks"][0]
    assert held["queue"] or held["inflight"]  # what one_step_off on split ranks would silently lose
    proc = run_train(second, [*common, "rollout.mode=one_step_off", *SPLIT, "trainer.total_steps=3",
                              f"trainer.resume={step_dir}"], nproc=2, timeout=900, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert ("CheckpointError: resume: the checkpoint holds queued groups or prompts in flight (saved with "
            "rollout.mode=streaming), which rollout.mode=one_step_off with rollout.split_ranks=1 cannot "
            "restore") in text
    assert not os.path.exists(os.path.join(second, "checkpoints", "global_step_3"))


LATER_FAULT = '''
import os

calls = []

def score(prompts, responses, batch):
    if os.environ["RANK"] == "2" and any(responses):  # the start-up check scores empty responses: let it pass
        calls.append(1)
        if len(calls) > 4:  # 2 batches for each of 2 training ranks, then the generation rank fails
            raise RuntimeError("reward server unreachable")
    return [0.0] * len(responses)
'''


def test_a_failed_generation_rank_leaves_the_trainers_data_position_in_the_faults_checkpoint(tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(LATER_FAULT)
    out = str(tmp_path / "run")
    proc = run_train(out, [*GRPO, *SPLIT, "rollout.mode=streaming", "rollout.max_staleness=0",
                           f"reward.functions=[{path}:score]", "trainer.dist_timeout_s=60", "trainer.total_steps=4"],
                     nproc=3, timeout=900, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "RuntimeError: reward server unreachable" in text, text[-3000:]
    assert "the generation ranks' queues cannot be saved (a generation rank failed)" in text, text[-3000:]
    ckpts = os.path.join(out, "checkpoints")
    latest = open(os.path.join(ckpts, "latest")).read().strip()  # the fault's checkpoint: the steps trained
    saved = safe_state.load(os.path.join(ckpts, latest, "trainer_state.json"))
    assert 1 <= saved["global_step"] < 4 and len(saved["async"]["ranks"]) == 2
    for rank in saved["async"]["ranks"]:  # nothing queued survived; generation resumes where the trainers stand
        assert rank["queue"] == [] and rank["inflight"] == [] and rank["redo"] == []
        assert rank["sampler"] == saved["sampler"]
