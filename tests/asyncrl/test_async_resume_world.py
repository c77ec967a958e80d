"""A streaming run's checkpoint resumed at another world size (real ranks, gloo, ZeRO-3 on CPU): the saved queue,
prompts in flight and sampler positions are dealt to the new ranks, so the steps after the resume train the
prompts the saved run trained at those steps, and a step made of saved groups trains their samples."""
import os

import pytest

from e2e_utils import run_train
from resume_testutil import PER_STEP, assert_resumed_like_saved
from verl_ds import safe_state

pytestmark = pytest.mark.slow  # real training runs / several processes


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("saved_world, resumed_world", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_trains_the_saved_runs_next_batches(tmp_path, saved_streaming_run, saved_world,
                                                                         resumed_world):
    # the 1-rank saved run is also the one test_split_resume.py's colocated-to-split resumes
    first, common = saved_streaming_run(saved_world, [])
    second = str(tmp_path / "second")
    step_dir = os.path.join(first, "checkpoints", "global_step_2")
    state = safe_state.load(os.path.join(step_dir, "trainer_state.json"))["async"]
    assert state["world_size"] == saved_world and len(state["ranks"]) == saved_world
    proc = run_train(second, [*common, f"trainer.resume={step_dir}"], nproc=resumed_world, timeout=900)
    assert f"dealt to {resumed_world}" in proc.stdout + proc.stderr
    assert_resumed_like_saved(first, second, state, PER_STEP // saved_world, require_queued=False)
