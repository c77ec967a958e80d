"""Split placement on 2 real ranks (gloo): rank 0 trains (ZeRO-3 in a world of its own), rank 1 only generates,
one step ahead; the weights go to rank 1 after every update over the bridge group. A generation rank that fails
stops the trainer with a message naming it."""
import pytest

from e2e_utils import merged, read_metrics, run_train

pytestmark = pytest.mark.slow  # real training runs / several processes

SPLIT = ["algo.adv_estimator=grpo", "rollout.n=2", "rollout.batch_size=4", "actor.mini_batch_size=8",
         "actor.micro_batch_size=4", "rollout.mode=one_step_off", "rollout.split_ranks=1", "trainer.export=none"]


def test_one_rank_generates_one_step_ahead_and_the_other_trains(tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(out, [*SPLIT, "trainer.total_steps=4"], nproc=2, timeout=900)
    assert "world_size=1" in proc.stdout  # the training ranks' own world
    rows = [r for r in read_metrics(out) if "training/global_step" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # batch 1 from the initial weights; batch k (k >= 2) made during step k-1, with the weights before its update
    assert [r["async/generated_at_step"] for r in rows] == [1.0, 1.0, 2.0, 3.0]
    assert all(r["timing_s/weight_sync"] > 0 and r["actor/grad_norm"] > 0 for r in rows)


FAULTY = '''
import os

def score(prompts, responses, batch):
    if os.environ["RANK"] == "1" and any(responses):  # the start-up check scores empty responses: let it pass
        raise RuntimeError("reward server unreachable")
    return [0.0] * len(responses)
'''


@pytest.mark.parametrize("mode", [[], ["rollout.mode=streaming", "rollout.max_staleness=1"]],
                         ids=["one_step_off", "streaming"])
def test_a_failing_generation_rank_stops_the_trainer_naming_it(tmp_path, mode):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    proc = run_train(str(tmp_path / "run"), merged(SPLIT, mode, [f"reward.functions=[{path}:score]",
                                                                 "trainer.dist_timeout_s=60", "trainer.total_steps=3"]),
                     nproc=2, timeout=900, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "RuntimeError: reward server unreachable" in text  # the generation rank's own traceback
    assert "rank 0: ProducerError: generation rank 1 (rollout.split_ranks) sent no batch" in text, text[-3000:]
