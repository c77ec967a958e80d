"""Checkpoints written by the code before the one-fit-loop change (tests/fixtures/old_checkpoints.tar.gz, made by
make_old_checkpoints.py at commit 3b0dc71) resume with today's code: steps 3-4 of the RL and the SFT job repeat what
the old code logged after its step-2 checkpoint, float for float. Exact, because a resume is bit-exact (as
tests/stages/test_sft_runs.py and tests/asyncrl/test_async_e2e.py assert) and the run here has the fixture's setting:
one process, one thread (e2e_utils.base_env), the fixture's overrides."""
import json
import os
import sys
import tarfile

import pytest

from e2e_utils import ROOT, base_env, read_metrics, run_group

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MAKE = os.path.join(FIXTURES, "make_old_checkpoints.py")
# the deterministic metrics each step logs that depend on the weights, the optimizer, the prompts drawn and the RNG
COMPARED = {
    "rl": ("training/global_step", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl",
           "actor/kl_coef", "actor/reward_kl_penalty", "kl_ctrl/observed", "critic/vf_loss", "critic/grad_norm",
           "rollout/score/mean", "rollout/rewards/mean", "response_length/mean"),
    "sft": ("training/global_step", "sft/loss", "actor/grad_norm", "sft/units"),
}


def _resume(job: str, tmp_path) -> tuple[str, str]:
    """Unpack the fixture, run ``job`` to step 4 from its step-2 checkpoint into a fresh output_dir (one process, as
    the fixture was made); returns (output_dir, the fixture copy)."""
    with tarfile.open(os.path.join(FIXTURES, "old_checkpoints.tar.gz")) as tar:
        tar.extractall(tmp_path / "fixtures", filter="data")
    fixture = str(tmp_path / "fixtures" / job)
    step_dir, out = os.path.join(fixture, "global_step_2"), str(tmp_path / "run")
    with open(os.path.join(fixture, "overrides.json")) as fh:
        overrides = [*json.load(fh), f"trainer.output_dir={out}", f"trainer.resume={step_dir}"]
    proc = run_group([sys.executable, MAKE, job, *overrides], env=base_env(), timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert f"resumed from {step_dir}" in log, log[-3000:]
    return out, fixture


@pytest.mark.parametrize("job", ["rl", "sft"])
def test_an_old_checkpoint_resumes_to_the_old_runs_steps(job, tmp_path):
    out, fixture = _resume(job, tmp_path)
    with open(os.path.join(fixture, "expected_metrics.jsonl")) as fh:
        expected = {r["step"]: r for r in map(json.loads, fh)}
    got = {r["step"]: r for r in read_metrics(out) if "training/global_step" in r}
    assert sorted(got) == [3, 4]  # the step came back: nothing before it was trained again
    for step in (3, 4):
        assert {k: got[step].get(k) for k in COMPARED[job]} == {k: expected[step][k] for k in COMPARED[job]}, step
    # the data order came back: two more batches after the checkpoint's two (a fresh sampler would stand at 2)
    with open(os.path.join(out, "checkpoints", "global_step_4", "trainer_state.json")) as fh:
        assert json.load(fh)["sampler"]["position"] == 4
