"""SharedState's progress snapshot on disk (``save``/``load``): the JSON object a checkpoint holds under
``shared_state``, so a snapshot and a checkpoint read each other; bad files are refused naming the path. The
checkpoint comes from the default job (launch/train.py, one step), whose output must also be free of transformers'
warning about our own generation settings (greedy evaluation once set top_k=0 with do_sample off)."""
import json
import os
import subprocess
import sys

import pytest

from e2e_utils import ROOT, TRAIN, base_env
from verl_ds.state import SharedState, SnapshotError


def _progressed() -> SharedState:
    s = SharedState(rank=0)
    s.update({"global_step": 12345, "actor_lr": 3e-5, "best_reward": 12.34, "reward_name": "parity", "kl_coef": 0.1})
    return s


def test_save_then_load_round_trips_values_and_version(tmp_path):
    s = _progressed()
    path = s.save(tmp_path / "state.json")
    assert os.listdir(tmp_path) == ["state.json"]  # written through a temp file, renamed into place
    t = SharedState(rank=1)  # any rank may read it
    t.load(path)
    assert t.snapshot() == s.snapshot() and t.version == s.version
    assert (t["global_step"], t["actor_lr"], t["best_reward"]) == (12345, 3e-5, 12.34)
    s.set("global_step", 12346)
    s.save(path)  # replaces the file whole
    t.load(path)
    assert t["global_step"] == 12346
    assert json.load(open(path)) == s.state_dict()


EXPECTED = "expected a SharedState snapshot"


@pytest.mark.parametrize("text, found", [
    ('{"format": 1, "version": 3, "values": {"global_step": 1', ["JSONDecodeError", EXPECTED]),  # cut short
    ("\x00\x01garbage", ["JSONDecodeError", EXPECTED]),
    ("[1, 2]", ["holds list", EXPECTED]),
    ('{"global_step": 3}', ["holds an object with keys ['global_step']", EXPECTED]),
    ('{"format": 2, "version": 1, "values": {}}', ["snapshot format 2; this version reads format 1"]),
    ('{"format": 1, "version": 1, "values": {"gamma": "x"}}', ["gamma: expected float, got str 'x'"]),
    ('{"format": 1, "version": -1, "values": {}}', ["'version' must be an int >= 0"]),
])
def test_a_bad_file_is_refused_naming_the_path_and_what_was_expected(tmp_path, text, found):
    path = tmp_path / "state.json"
    path.write_text(text)
    s = _progressed()
    before = (s.snapshot(), s.version)
    with pytest.raises(SnapshotError) as err:
        s.load(path)
    message = str(err.value)
    assert str(path) in message and all(f in message for f in found), message
    assert (s.snapshot(), s.version) == before  # nothing applied


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(SnapshotError, match=r"state\.json: FileNotFoundError.*expected a SharedState snapshot"):
        SharedState(rank=0).load(tmp_path / "state.json")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default job (configs/default.yaml) for one step: its output and its final checkpoint."""
    out = str(tmp_path_factory.mktemp("default") / "run")
    proc = subprocess.run([sys.executable, TRAIN, "trainer.total_steps=1", f"trainer.output_dir={out}"], cwd=ROOT,
                          env=base_env(), text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc, os.path.join(out, "checkpoints", "global_step_1")


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_checkpoint_and_a_snapshot_read_each_other(default_run, tmp_path):
    _, step_dir = default_run
    saved = json.load(open(os.path.join(step_dir, "trainer_state.json")))["shared_state"]
    s = SharedState(rank=0)
    s.load(step_dir)  # the checkpoint directory
    assert s["global_step"] == 1 and s["actor_version"] >= 1 and s.version == saved["version"]
    assert s.snapshot() == saved["values"]
    t = SharedState(rank=0)
    t.load(os.path.join(step_dir, "trainer_state.json"))  # or its state file
    assert t.snapshot() == s.snapshot()
    # the other way: what save writes is the object the checkpoint holds (resume reads it with load_state_dict)
    assert json.load(open(s.save(tmp_path / "snapshot.json"))) == saved


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_the_default_run_prints_no_warning_about_our_generation_flags(default_run):
    proc, _ = default_run
    output = proc.stdout + proc.stderr
    assert "generation flags are not valid" not in output, [ln for ln in output.splitlines() if "flags" in ln]
