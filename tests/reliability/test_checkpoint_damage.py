"""Real checkpoints of real tiny runs, damaged or tampered with, then resumed by launch/train.py (issue 31, items 1
and 13): a pickle payload in the state files never runs; an older format still resumes exactly; damage that
"full" finds, and NaNs in the middle of a shard that only the run itself finds, fall back to the previous
checkpoint and train on; every checkpoint damaged is refused instead of a silent start at step 0; a full disk
during a save is named as such."""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from ckpt_damage_util import (copy_run, flip_middle_bit, nan_in_the_middle, optim_shard, rewrite_manifest, to_format_1,
                              write_payload)
from e2e_utils import FAST, ROOT, TRAIN, base_env, merged, read_metrics, run_train
from verl_ds.checkpoint import verify

pytestmark = pytest.mark.slow  # real training runs

COMMON = ["trainer.export=none", "trainer.val_every=0", "trainer.checkpoint_digest=full"]
BIG = ["model.config_overrides.hidden_size=128", "model.config_overrides.intermediate_size=512"]  # optimizer shards of ~6 MB: a middle the edges miss
SKIP_METRICS = ("timing_s/", "perf/")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """4 steps, a checkpoint after each."""
    out = str(tmp_path_factory.mktemp("small") / "run")
    run_train(out, [*COMMON, "trainer.total_steps=4", "trainer.save_every=1", "trainer.keep_last=4"])
    return out


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    """4 steps of a wider model, checkpoints at steps 2 and 4."""
    out = str(tmp_path_factory.mktemp("big") / "run")
    run_train(out, [*COMMON, *BIG, "trainer.total_steps=4", "trainer.save_every=2", "trainer.keep_last=3"])
    return out


@pytest.fixture(scope="module")
def big_edges_run(tmp_path_factory):
    """big_run saved with edge digests only (the default): a resume checks each file's first and last MiB."""
    out = str(tmp_path_factory.mktemp("big_edges") / "run")
    run_train(out, [*COMMON[:-1], "trainer.checkpoint_digest=edges", *BIG, "trainer.total_steps=4",
                    "trainer.save_every=2", "trainer.keep_last=3"])
    return out


def _ckpt(out: str, step: int) -> str:
    return os.path.join(out, "checkpoints", f"global_step_{step}")


def _rewind(src: str, dst: str, step: int) -> str:
    """A copy of the run as it was right after checkpoint ``step``'s save."""
    copy_run(src, dst)
    for name in os.listdir(os.path.join(dst, "checkpoints")):
        if name.startswith("global_step_") and int(name.split("_")[-1]) > step:
            shutil.rmtree(os.path.join(dst, "checkpoints", name))
    with open(os.path.join(dst, "checkpoints", "latest"), "w") as fh:
        fh.write(f"global_step_{step}")
    return dst


def _step_rows(out: str) -> dict:
    return {m["step"]: m for m in read_metrics(out) if "rollout/score/mean" in m}


def _assert_same_step(a: str, b: str, step: int) -> None:
    x, y = _step_rows(a)[step], _step_rows(b)[step]
    assert x.keys() == y.keys()
    for k in x:
        if not k.startswith(SKIP_METRICS):
            assert x[k] == y[k], f"metric {k} at step {step}: {x[k]} vs {y[k]}"


def _one_line_error(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc.stderr


# ------------------------------------------------------------------------------------------------- item 1


def test_a_pickle_payload_beside_the_state_never_runs_and_the_resume_stays_exact(small_run, tmp_path):
    """trainer_state.pt and rng_rank0.pt with a payload, the manifest recomputed over them (it is not signed): the
    resume reads the JSON state only, nothing runs, and step 4 equals the uninterrupted run's step 4."""
    out, marker = _rewind(small_run, str(tmp_path / "run"), 3), str(tmp_path / "pwned")
    for name in ("trainer_state.pt", "rng_rank0.pt"):
        write_payload(os.path.join(_ckpt(out, 3), name), marker)
    rewrite_manifest(_ckpt(out, 3))
    assert verify(_ckpt(out, 3), "full") is None
    proc = run_train(out, [*COMMON, "trainer.total_steps=4"], check=False)
    assert not os.path.exists(marker), "the payload ran at resume"
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {_ckpt(out, 3)}" in proc.stdout + proc.stderr
    _assert_same_step(small_run, out, 4)


def test_a_pickle_payload_in_an_old_format_checkpoint_is_refused_by_name(small_run, tmp_path):
    """The same files in a checkpoint whose manifest says the old (pickled) format: read with torch's restricted
    unpickler, the payload is refused with a one-line error naming the file and what to do; nothing runs."""
    out, marker = _rewind(small_run, str(tmp_path / "run"), 3), str(tmp_path / "pwned")
    step_dir = _ckpt(out, 3)
    for name in ("trainer_state.pt", "rng_rank0.pt"):
        write_payload(os.path.join(step_dir, name), marker)
    rewrite_manifest(step_dir, keep_format=False)
    proc = run_train(out, [*COMMON, "trainer.total_steps=4"], check=False)
    assert not os.path.exists(marker), "the payload ran at resume"
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = _one_line_error(proc)
    assert f"verl_ds: error: CheckpointError: refusing to resume from {step_dir}: {step_dir}/trainer_state.pt cannot " \
           "be read as data only" in err, err[-3000:]
    assert "trainer.resume=none" in err and "weights_only=False" not in err


def test_a_checkpoint_of_the_old_pickled_format_still_resumes_exactly(small_run, tmp_path):
    """A format-1 checkpoint (trainer state and RNG pickled by torch.save) resumes through the restricted unpickler;
    step 4 equals the uninterrupted run's, and the new checkpoint is written in the data-only format."""
    out = _rewind(small_run, str(tmp_path / "run"), 3)
    to_format_1(_ckpt(out, 3))
    proc = run_train(out, [*COMMON, "trainer.total_steps=4"])
    assert f"resumed from {_ckpt(out, 3)}" in proc.stdout + proc.stderr
    _assert_same_step(small_run, out, 4)
    new = _ckpt(out, 4)
    assert json.load(open(os.path.join(new, "COMPLETE")))["format"] == 2
    assert sorted(n for n in os.listdir(new) if n.startswith(("rng", "trainer"))) == \
        ["rng_rank0.json", "rng_rank0.safetensors", "trainer_state.json"]


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_latest_never_resumes_another_runs_checkpoint(small_run, tmp_path, caplog, how):
    """'latest' naming ../../other/checkpoints/global_step_4, an absolute path, or a step directory that is a link
    into another run: this run's own newest checkpoint is chosen, and the foreign name is reported."""
    import logging

    from verl_ds.checkpoint import find_resumable

    other = copy_run(small_run, str(tmp_path / "other"))
    out = _rewind(small_run, str(tmp_path / "run"), 2)
    target = _ckpt(other, 4)
    root = os.path.join(out, "checkpoints")
    if how == "symlink":
        os.symlink(target, os.path.join(root, "global_step_9"))
        name = "global_step_9"
    else:
        name = os.path.relpath(target, root) if how == "relative" else target
    with open(os.path.join(root, "latest"), "w") as fh:
        fh.write(name)
    assert os.path.isdir(os.path.join(root, name)) and verify(os.path.join(root, name)) is None
    with caplog.at_level(logging.WARNING, logger="verl_ds.checkpoint"):
        assert find_resumable(root) == _ckpt(out, 2)
    if how == "symlink":
        assert f"skipping checkpoint {os.path.join(root, name)}: a link to {target}, outside this run" in caplog.text
    else:
        assert f"ignoring 'latest' in {root}: it names {name!r}, not a global_step_<N> directory of this run" \
            in caplog.text


def test_a_file_left_out_of_the_manifest_is_not_trusted(small_run, tmp_path):
    """The actor's optimizer shard truncated and its manifest entry removed (sizes and digests recomputed for the
    rest): verification names the unlisted file (it used to pass, then fail inside torch's zip reader)."""
    out = copy_run(small_run, str(tmp_path / "run"))
    step_dir = _ckpt(out, 4)
    shard = optim_shard(step_dir)
    with open(shard, "r+b") as fh:
        fh.truncate(1000)
    rel = os.path.relpath(shard, step_dir)
    rewrite_manifest(step_dir, drop=(rel,))
    for mode in ("sizes", "edges"):
        assert verify(step_dir, mode) == f"file {rel} is not in the manifest (added after the save, or its entry " \
                                         "removed; 1 such file(s))"
    from verl_ds.checkpoint import find_resumable

    assert find_resumable(os.path.join(out, "checkpoints")) == _ckpt(out, 3)


# ------------------------------------------------------------------------------------------------ item 13


def test_damage_found_by_full_verification_falls_back_to_the_previous_checkpoint(big_run, tmp_path):
    """A flipped bit in the middle of a 6 MB shard: invisible to the edge digests, found by the whole-file digests
    the run saved (trainer.checkpoint_digest=full: a resume checks what a checkpoint was saved with); the run names it, resumes from the previous checkpoint and trains on (it used to end in a traceback)."""
    out = copy_run(big_run, str(tmp_path / "run"))
    shard = optim_shard(_ckpt(out, 4))
    assert os.path.getsize(shard) > 4 << 20
    flip_middle_bit(shard)
    assert verify(_ckpt(out, 4), "edges") is None and verify(_ckpt(out, 4), "full") is not None
    proc = run_train(out, [*COMMON, *BIG, "trainer.total_steps=5"], check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (f"skipping checkpoint {_ckpt(out, 4)}: file actor/state/zero_pp_rank_0_mp_rank_00_optim_states.pt is "
            "corrupt (the sha256 of its bytes differs from the manifest's)") in log, log[-4000:]
    assert f"resumed from {_ckpt(out, 2)}" in log
    assert sorted(_step_rows(out)) == [1, 2, 3, 4, 5]


def test_nans_in_the_middle_of_a_shard_fall_back_and_sampling_recovers(big_edges_run, tmp_path):
    """16 NaNs in the middle of the actor's optimizer shard pass the edge digests (a checkpoint saved with
    trainer.checkpoint_digest=edges is verified by its edges); the resumed run goes non-finite, falls back once to
    step 2, and the generation replica takes the restored weights: steps 3-8 train finitely (it used to sample from
    the NaN weights until max_bad_steps stopped the job)."""
    out = copy_run(big_edges_run, str(tmp_path / "run"))
    shard = optim_shard(_ckpt(out, 4))
    nan_in_the_middle(shard, 16)
    assert verify(_ckpt(out, 4), "edges") is None
    proc = run_train(out, [*COMMON[:-1], "trainer.checkpoint_digest=edges", *BIG, "trainer.total_steps=8",
                           "trainer.max_bad_steps=2"], check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert log.count("falling back once to the previous complete checkpoint") == 1
    assert f"resumed from {_ckpt(out, 2)}" in log
    rows = _step_rows(out)
    assert sorted(rows) == list(range(1, 9))
    assert [rows[s]["training/consecutive_bad_steps"] for s in range(3, 9)] == [0] * 6


def test_every_checkpoint_damaged_is_refused_instead_of_starting_over(small_run, tmp_path):
    """Each complete checkpoint has a truncated shard: resume=auto stops with one line naming them and saying how to
    start fresh on purpose; the run directory's metrics are left as they were (it used to start at step 0, exit 0)."""
    out = copy_run(small_run, str(tmp_path / "run"))
    for step in (1, 2, 3, 4):
        shard = optim_shard(_ckpt(out, step), "critic")
        with open(shard, "r+b") as fh:
            fh.truncate(os.path.getsize(shard) // 2)
    before = open(os.path.join(out, "metrics.jsonl")).read()
    proc = run_train(out, [*COMMON, "trainer.total_steps=6"], check=False)
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = _one_line_error(proc)
    assert "CheckpointError: trainer.resume=auto: none of the 4 complete checkpoint(s)" in err, err[-3000:]
    assert f"{_ckpt(out, 1)}: file critic/state/zero_pp_rank_0_mp_rank_00_optim_states.pt has" in err
    assert "start fresh on purpose with trainer.resume=none" in err
    assert open(os.path.join(out, "metrics.jsonl")).read() == before
    assert not os.path.exists(os.path.join(out, "metrics.jsonl.prev"))


def _limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_full_disk_during_a_save_is_named_with_the_path(tmp_path):
    """Writes past a file size limit (RLIMIT_FSIZE: EFBIG, what a full disk looks like to torch's zip writer) make the
    first save fail: one line that names disk space and the checkpoint's path (it used to be 'RuntimeError:
    unexpected pos'); 'latest' never names the partial directory."""
    out = str(tmp_path / "run")
    args = [sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, COMMON,
                                          ["trainer.total_steps=2", "trainer.save_every=1"])]
    proc = subprocess.run(args, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_file_size(150_000))
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = _one_line_error(proc)
    step_dir = _ckpt(out, 1)
    assert f"CheckpointError: cannot save checkpoint {step_dir} (rank 0): " in err, err[-3000:]
    assert "out of disk space?" in err and "Free disk space" in err
    assert "may not write files larger than 150000 bytes (ulimit -f)" in err
    assert not os.path.exists(os.path.join(out, "checkpoints", "latest"))
