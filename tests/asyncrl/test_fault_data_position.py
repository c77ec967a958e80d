"""A step that fails before any update (a reward function raising on one rank) hands its prompts back before the
fault's checkpoint: the synchronous sampler is rewound, and under one_step_off every rank's groups taken for the
step go back to the front of its queue. The checkpoint then continues with the prompts the failed step would have
trained, exactly as the checkpoint of an uninterrupted run stopped at the same step does. Real runs (gloo, ZeRO-3 on
CPU); before this, the checkpoint skipped the failed step's prompts."""
import os

import pytest

from e2e_utils import base_env, run_train
from verl_ds import safe_state
from verl_ds.sampler import DistributedPromptSampler

pytestmark = pytest.mark.slow  # real training runs / several processes

GRPO = ["algo.adv_estimator=grpo", "rollout.n=2", "rollout.batch_size=8", "actor.mini_batch_size=8",
        "actor.micro_batch_size=4", "trainer.val_every=0", "trainer.export=none", "trainer.dist_timeout_s=120",
        "trainer.save_every=0"]  # the fault writes the checkpoint of step 2
# the reward fails on rank FAIL_RANK from its third training batch on (a batch of FAIL_SIZE responses: the
# start-up checks score other sizes)
FAILS_AT_STEP_3 = '''
import os

calls = []

def score(prompts, responses, batch):
    if os.environ.get("RANK", "0") == os.environ.get("FAIL_RANK") and len(responses) == int(os.environ["FAIL_SIZE"]):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("reward server unreachable")
    return [0.0] * len(responses)
'''


def _upcoming(rank: dict, r: int, world: int, batches: int) -> list:
    """The data set indices rank ``r``'s saved state trains next, in order: its queued groups, prompts in flight
    and to redo, then its sampler's next batches (``batches`` steps' worth)."""
    s = rank["sampler"]
    per_rank = int(s["global_batch_size"]) // world
    sampler = DistributedPromptSampler(int(s["dataset_len"]), per_rank, r, world, seed=int(s["seed"]))
    sampler.load_state_dict(s)
    items = [g["index"] for g in rank.get("queue", [])] + [int(i) for i, _ in rank.get("inflight", [])]
    items += [x["index"] if isinstance(x, dict) else int(x) for x in rank.get("redo", [])]
    while len(items) < batches * per_rank:
        items += sampler.next_batch()
    return items[:batches * per_rank]


def _saved(out: str) -> dict:
    ckpts = os.path.join(out, "checkpoints")
    latest = open(os.path.join(ckpts, "latest")).read().strip()
    return safe_state.load(os.path.join(ckpts, latest, "trainer_state.json"))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode, nproc", [("sync", 1), ("one_step_off", 2)])
def test_the_faults_checkpoint_continues_with_the_failed_steps_prompts(tmp_path, mode, nproc):
    reward = tmp_path / "fails.py"
    reward.write_text(FAILS_AT_STEP_3)
    common = [*GRPO, f"rollout.mode={mode}", f"reward.functions=[{reward}:score]"]
    failed = run_train(str(tmp_path / "failed"), [*common, "trainer.total_steps=4"], nproc=nproc, timeout=900,
                       env=base_env(FAIL_RANK=nproc - 1, FAIL_SIZE=8 * 2 // nproc), check=False)
    text = failed.stdout + failed.stderr
    assert failed.returncode != 0 and "reward server unreachable" in text, text[-3000:]
    assert "the run is ending on a fault at step 2" in text, text[-3000:]
    run_train(str(tmp_path / "clean"), [*common, "trainer.total_steps=2"], nproc=nproc, timeout=900,
              env=base_env(FAIL_RANK="none", FAIL_SIZE=0))
    got, want = _saved(str(tmp_path / "failed")), _saved(str(tmp_path / "clean"))
    assert got["global_step"] == want["global_step"] == 2
    if mode == "sync":
        assert got["sampler"] == want["sampler"]
        return
    for r, (g, w) in enumerate(zip(got["async"]["ranks"], want["async"]["ranks"])):
        assert _upcoming(g, r, nproc, 2) == _upcoming(w, r, nproc, 2), f"rank {r}: {g} vs {w}"
    assert got["async"]["ranks"][0]["queue"], "rank 0 had taken its step-3 groups: they are back in its queue"
