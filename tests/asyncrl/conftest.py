"""Runs that several asyncrl test files check, each run once per session: the synchronous 2-rank GRPO run the
streaming runs at max_staleness 0 must equal, and the saving runs the streaming resume tests resume from (a resume
writes to a directory of its own, so one saved run serves every test resuming it)."""
import pytest

from e2e_utils import run_train
from resume_testutil import SYNC_GRPO, streaming_run


@pytest.fixture(scope="session")
def sync_grpo_run(tmp_path_factory) -> str:
    """The directory of the synchronous run of SYNC_GRPO on 2 ranks (4 steps, a checkpoint at step 2)."""
    out = str(tmp_path_factory.mktemp("sync_grpo") / "sync")
    run_train(out, SYNC_GRPO, nproc=2, timeout=900)
    return out


@pytest.fixture(scope="session")
def saved_streaming_run(tmp_path_factory):
    """``get(nproc, extra)``: (run directory, overrides) of streaming_run's job plus ``extra`` on ``nproc`` ranks,
    saved at step 2 of 5; the same placement asked again is the same run. A resume uses the returned overrides
    (their reward file is the saved run's)."""
    done = {}

    def get(nproc: int, extra: list) -> tuple:
        key = (nproc, tuple(extra))
        if key not in done:
            root = tmp_path_factory.mktemp("saved_streaming")
            common = [*streaming_run(root), *extra]
            out = str(root / "first")
            run_train(out, common, nproc=nproc, timeout=900)
            done[key] = (out, common)
        return done[key]
    return get
