"""What the streaming resume tests share (test_async_resume_world.py, test_split_resume.py, test_async_e2e.py): a
reward that tells which prompts a step trained, the runs' overrides, and the check that the resumed steps trained the
saved run's."""
import pytest

from e2e_utils import read_metrics

# every prompt scores its own number: a step's mean score (over every rank's samples) tells which prompts it trained
FINGERPRINT = '''
import zlib

def score(prompts, responses, batch):
    return [zlib.crc32(p.encode()) % 1000 / 1000 for p in prompts]
'''
PER_STEP = 4  # rollout.batch_size: prompts per global batch
# the synchronous GRPO job that streaming at max_staleness 0 must equal bit for bit (conftest.sync_grpo_run runs it
# once on 2 ranks for test_async_e2e.py and test_split_resume.py); max_staleness, unused by sync, is set in both runs:
# SharedState's change counter (state/version) counts it
GRPO = ["algo.adv_estimator=grpo", "rollout.n=2", f"rollout.batch_size={PER_STEP}", "actor.mini_batch_size=8",
        "actor.micro_batch_size=4", "trainer.val_every=0", "trainer.export=none"]
SYNC_GRPO = [*GRPO, "trainer.total_steps=4", "trainer.save_every=2", "rollout.max_staleness=0"]


def assert_equal_runs(got: dict, expected: dict) -> None:
    """Two runs' per-step metrics are equal floats, but the KL controller's observed KL: a mean of ~3e-4 of float32
    log-prob differences, whose last-bit differences reach its 6th digit (4e-6 relative on 2-core AMD EPYCs while
    every loss, score, length and grad norm stayed equal), compared to 1e-4 relative."""
    got, expected = {s: dict(r) for s, r in got.items()}, {s: dict(r) for s, r in expected.items()}
    for step in expected:
        observed = "kl_ctrl/observed"
        assert got[step].pop(observed) == pytest.approx(expected[step].pop(observed), rel=1e-4, abs=0), step
    assert got == expected


def rows(out: str) -> dict:
    return {r["step"]: r for r in read_metrics(out) if "training/global_step" in r}


def streaming_run(tmp_path) -> list:
    """GRPO streaming at max_staleness 2 scored by FINGERPRINT, saving at step 2 of 5."""
    path = tmp_path / "fingerprint.py"
    path.write_text(FINGERPRINT)
    return ["algo.adv_estimator=grpo", "rollout.n=2", f"rollout.batch_size={PER_STEP}", "actor.mini_batch_size=8",
            "actor.micro_batch_size=4", "trainer.val_every=0", "trainer.export=none", "rollout.mode=streaming",
            "rollout.max_staleness=2", "rollout.max_new_tokens=12", f"reward.functions=[{path}:score]",
            "trainer.save_every=2", "trainer.keep_last=3", "trainer.total_steps=5"]


def assert_resumed_like_saved(first: str, second: str, state: dict, per_rank: int, require_queued: bool) -> None:
    """Steps 3-5 of ``second`` (resumed from ``first``'s step 2, whose async ``state`` is given) trained the prompts
    ``first`` trained, and the very samples for the steps every saved rank had queued whole."""
    expected, got = rows(first), rows(second)
    assert sorted(got) == [3, 4, 5]
    # no group outlived the bound in either run (a producer that started a batch a step early made one stale and
    # regenerated it: the saved run's order then depended on thread timing)
    assert all(r["async/stale_groups"] == 0 for r in [*expected.values(), *got.values()])
    for step in (3, 4, 5):  # the same prompts: the queued and in-flight ones, then the sampler's next batches
        for key in ("rollout/score/mean", "prompt_length/mean"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)
    queued = min(len(r["queue"]) for r in state["ranks"]) // per_rank
    if require_queued:
        assert queued >= 1, [len(r["queue"]) for r in state["ranks"]]
    for step in range(3, 3 + min(queued, 3)):
        assert got[step]["response_length/mean"] == pytest.approx(expected[step]["response_length/mean"], rel=1e-6)
