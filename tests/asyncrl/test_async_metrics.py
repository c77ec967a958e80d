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
from verl_ds.config import load_config
from verl_ds.trainer import Trainer

trainer = Trainer(load_config(None, json.loads(sys.argv[2])), vdist.detect_launch())
os.environ["SCORE"] = "1.0"
trainer.train_step()  # step 1; the generation thread makes step 2's batch meanwhile, scored 1.0
deadline = time.monotonic() + 600
while len(trainer.asyncrl.queue) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
state = trainer.asyncrl.state_dict()
trainer.asyncrl.close()
# the checkpoint as if it had been written while step 2's second prompt was still being generated
mine = state["ranks"][0]
kept, pending = mine["queue"][:2]
if sys.argv[3] == "queued_first":
    mine.update(queue=[kept], inflight=[[pending["index"], 2]], redo=[])
else:  # the prompt first, then the saved group
    mine.update(queue=[], inflight=[], redo=[pending["index"], kept])
os.environ["SCORE"] = "0.25"
trainer.asyncrl = AsyncRollout(trainer)  # what a resumed run starts with
trainer.asyncrl.load_state_dict(state)
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
