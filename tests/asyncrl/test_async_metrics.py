"""The reward metrics of an asynchronous step describe the samples it trains, also when its groups come from two
generation calls (a real Trainer at world size 1, a real generation thread and HF generate): a checkpoint's queued
group (scored 1.0) and a prompt that was in flight, generated again after the resume (scored 0.25). A saved group
that follows a prompt to generate (dealt so by a resume at another world size) is queued in its turn."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "engines"))
sys.path.insert(0, os.path.dirname(HERE))
from dist_testutil import run_ranks  # noqa: E402
from e2e_utils import FAST, merged  # noqa: E402

pytestmark = pytest.mark.slow  # a DeepSpeed engine and a generation thread

REWARD = '''
import os

def score(prompts, responses, batch):
    return [float(os.environ.get("SCORE", "1.0"))] * len(responses)
'''

WORKER = r'''
import json, os, sys, time
from verl_ds import dist as vdist
from verl_ds.asyncrl.producer import AsyncRollout
from verl_ds.asyncrl.source import RolloutRun
from verl_ds.config import load_config
from verl_ds.trainer import Trainer

trainer = Trainer(load_config(None, json.loads(sys.argv[2])), vdist.detect_launch())
os.environ["SCORE"] = "1.0"
trainer.train_step()  # step 1; the generation thread makes step 2's batch meanwhile, scored 1.0
deadline = time.monotonic() + 600
while len(trainer.rollout_source.queue) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
state = trainer.rollout_source.state_dict()
trainer.rollout_source.close()
# the checkpoint as if it had been written while step 2's second prompt was still being generated
mine = state["ranks"][0]
kept, pending = mine["queue"][:2]
if sys.argv[3] == "queued_first":
    mine.update(queue=[kept], inflight=[[pending["index"], 2]], redo=[])
else:  # the prompt first, then the saved group
    mine.update(queue=[], inflight=[], redo=[pending["index"], kept])
os.environ["SCORE"] = "0.25"
trainer.rollout_source = AsyncRollout(RolloutRun.of(trainer))  # what a resumed run starts with
trainer.rollout_source.load_state_dict(state)
metrics = trainer.train_step()
trainer.close()
json.dump({"metrics": metrics, "kept": kept["extras"]["prompt"], "pending": pending["extras"]["prompt"]},
          open(sys.argv[1] % vdist.rank(), "w"))
vdist.shutdown()
'''


@pytest.mark.timeout(900)
@pytest.mark.parametrize("order", ["queued_first", "prompt_first"])
def test_a_step_of_two_generation_calls_logs_the_mean_reward_of_the_samples_it_trains(tmp_path, order):
    import json

    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    overrides = merged([f"trainer.output_dir={tmp_path / 'run'}"], FAST, [
        "algo.adv_estimator=grpo", "rollout.n=2", "rollout.batch_size=2", "actor.mini_batch_size=4",
        "actor.micro_batch_size=2", "trainer.val_every=0", "trainer.export=none", "trainer.device=cpu",
        "rollout.mode=streaming", "rollout.max_staleness=1", f"reward.functions=[{path}:score]"])
    (res,) = run_ranks(WORKER, 1, tmp_path, args=(json.dumps(overrides), order), timeout=800)
    m = res["metrics"]
    # 2 samples scored 1.0 (the saved group) and 2 scored 0.25 (its prompt generated again): (2 + 0.5) / 4
    assert m["training/global_step"] == 2
    assert m["reward/score/mean"] == pytest.approx(0.625, abs=1e-7)
    assert m["rollout/score/mean"] == pytest.approx(0.625, abs=1e-7)


SWAP_WORKER = r'''
import json, sys
import torch
from verl_ds import dist as vdist
from verl_ds.asyncrl.stream import taken_samples
from verl_ds.asyncrl.queue import Group
from verl_ds.metrics import reduce_metrics, sample_means_over_ranks
from verl_ds.rollout import Rollout

vdist.init_distributed(vdist.detect_launch(), 60, "cpu")
rank = vdist.rank()


def group(values: dict) -> Group:  # the per-sample reward values of one prompt's 2 samples
    return Group(batch=None, responses=[], index=0, versions=torch.zeros(2, 1, dtype=torch.int64),
                 per_sample={k: torch.tensor(v) for k, v in values.items()})


# the groups each rank's step takes; rank 1's generation thread crossed the reward swap one batch earlier
cases = {"mixed": [[{"reward/parity/mean": [1.0, 0.0]}, {"reward/parity/mean": [1.0, 1.0]}],
                   [{"reward/parity/mean": [0.0, 0.0]}, {"reward/swapped/mean": [0.5, 1.0]}]],
         "one_each": [[{"reward/parity/mean": [1.0, 1.0]}], [{"reward/swapped/mean": [0.25, 0.25]}]]}
out = {}
for name, per_rank in cases.items():
    rollout = Rollout(batch=None, responses=[], metrics={"async/queue_len": torch.tensor(1.0)},
                      per_sample=taken_samples([group(g) for g in per_rank[rank]]))
    # the trainer's assembly of the step's metrics (verl_ds.trainer.Trainer.train_step), reduced over the ranks
    out[name] = reduce_metrics({**rollout.metrics, **sample_means_over_ranks(rollout.per_sample)})
json.dump(out, open(sys.argv[1] % rank, "w"))
vdist.shutdown()
'''


@pytest.mark.timeout(300)
def test_reward_metrics_pair_by_name_over_ranks_whose_groups_were_scored_by_different_rewards(tmp_path):
    """Around a reward swap the ranks' generation threads cross it at different batches: a step's groups on one rank
    carry reward/<old>/mean, on another reward/<new>/mean. Each is the mean over every rank's samples that have it,
    logged under its own name on every rank (the per-rank means were all-reduced in sorted-name order: a name only
    some ranks had was paired with another's value, or the collective's sizes differed)."""
    results = run_ranks(SWAP_WORKER, 2, tmp_path, timeout=240)
    for res in results:
        # by hand: parity's samples 1, 0, 1, 1 (rank 0) and 0, 0 (rank 1); swapped's 0.5, 1.0 (rank 1)
        assert res["mixed"] == {"async/queue_len": 1.0, "reward/parity/mean": pytest.approx(0.5),
                                "reward/swapped/mean": pytest.approx(0.75)}
        assert res["one_each"] == {"async/queue_len": 1.0, "reward/parity/mean": pytest.approx(1.0),
                                   "reward/swapped/mean": pytest.approx(0.25)}
    assert results[0] == results[1]
