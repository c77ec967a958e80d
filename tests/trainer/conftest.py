"""The update probes (update_probe.py runs, one real update each) shared by test_invariance.py and
test_sequence_parallel_update.py: a probe asked for twice in a session, from either file, runs once (the one-rank
baseline is the reference of both files)."""
import pytest


@pytest.fixture(scope="session")
def probes(tmp_path_factory):
    """Probe runs by name, each run once for the session (``probes(name, overrides, nproc, **env)``); a name asked
    again with other overrides, world size or environment is an error, not a silent reuse."""
    from test_invariance import _probe

    root, done = tmp_path_factory.mktemp("probes"), {}

    def get(name: str, overrides: list, nproc: int = 1, **env) -> dict:
        args = (list(overrides), nproc, sorted(env.items()))
        if name not in done:
            done[name] = (args, _probe(root, name, overrides, nproc, **env))
        assert done[name][0] == args, f"probe {name!r} asked with {args}, run with {done[name][0]}"
        return done[name][1]
    return get


# the first 2 steps of test_e2e_train.py's 2-rank exact-resume job; test_resume.py resumes them on 1 rank and
# starts a fresh run over them
TWO_RANK_START = ["trainer.export=merged", "trainer.val_every=0", "trainer.total_steps=2"]


@pytest.fixture(scope="session")
def two_rank_start(tmp_path_factory):
    """``copy_to(dst)``: a copy at ``dst`` of one run of TWO_RANK_START on 2 ranks (ZeRO-3), finished with its
    checkpoint at step 2, for a test to resume (the run itself stays untouched for the next test)."""
    import shutil

    from e2e_utils import run_train

    src = str(tmp_path_factory.mktemp("two_rank_start") / "run")
    run_train(src, TWO_RANK_START, nproc=2)

    def copy_to(dst: str) -> str:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("run.lock"))
        return dst
    return copy_to
