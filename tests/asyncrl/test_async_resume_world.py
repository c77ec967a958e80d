"""A streaming run's checkpoint resumed at another world size (real ranks, gloo, ZeRO-3 on CPU): the saved queue,
prompts in flight and sampler positions are dealt to the new ranks, so the steps after the resume train the
prompts the saved run trained at those steps, and a step made of saved groups trains their samples."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "reliability"))
from e2e_utils import read_metrics, run_train  # noqa: E402
from verl_ds import safe_state  # noqa: E402

pytestmark = pytest.mark.slow  # real training runs / several processes

# every prompt scores its own number: a step's mean score (over every rank's samples) tells which prompts it trained
FINGERPRINT = '''
import zlib

def score(prompts, responses, batch):
    return [zlib.crc32(p.encode()) % 1000 / 1000 for p in prompts]
'''
PER_STEP = 4  # rollout.batch_size: prompts per global batch


def _rows(out: str) -> dict:
    return {r["step"]: r for r in read_metrics(out) if "training/global_step" in r}


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("saved_world, resumed_world", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_trains_the_saved_runs_next_batches(tmp_path, saved_world, resumed_world):
    path = tmp_path / "fingerprint.py"
    path.write_text(FINGERPRINT)
    common = ["algo.adv_estimator=grpo", "rollout.n=2", f"rollout.batch_size={PER_STEP}", "actor.mini_batch_size=8",
              "actor.micro_batch_size=4", "trainer.val_every=0", "trainer.export=none", "rollout.mode=streaming",
              "rollout.max_staleness=2", "rollout.max_new_tokens=12", f"reward.functions=[{path}:score]",
              "trainer.save_every=2", "trainer.keep_last=3", "trainer.total_steps=5"]
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run_train(first, common, nproc=saved_world, timeout=900)
    step_dir = os.path.join(first, "checkpoints", "global_step_2")
    state = safe_state.load(os.path.join(step_dir, "trainer_state.json"))["async"]
    assert state["world_size"] == saved_world and len(state["ranks"]) == saved_world
    proc = run_train(second, [*common, f"trainer.resume={step_dir}"], nproc=resumed_world, timeout=900)
    assert f"dealt to {resumed_world}" in proc.stdout + proc.stderr
    expected, got = _rows(first), _rows(second)
    assert sorted(got) == [3, 4, 5]
    # no group outlived the bound in either run (a producer that started a batch a step early made one stale and
    # regenerated it: the saved run's order then depended on thread timing)
    assert all(r["async/stale_groups"] == 0 for r in [*expected.values(), *got.values()])
    for step in (3, 4, 5):  # the same prompts: the queued and in-flight ones, then the sampler's next batches
        for key in ("rollout/score/mean", "prompt_length/mean"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)
    # a step for which every saved rank had its whole share queued trains those very samples
    per_rank = PER_STEP // saved_world
    queued = min(len(r["queue"]) for r in state["ranks"]) // per_rank
    for step in range(3, 3 + min(queued, 3)):
        assert got[step]["response_length/mean"] == pytest.approx(expected[step]["response_length/mean"], rel=1e-6)
