"""verl_ds.runtime, verl_ds.testing.faults and verl_ds.checkpoint in-process: the fault grammar, the signal flag, the non-finite guard's
batch check and forensic record, checkpoint verification and the choice of the checkpoint to resume from."""
import json
import logging
import os
import re
import signal

import pytest
import torch

from verl_ds import checkpoint as ckpt
from verl_ds.batch import RolloutBatch
from verl_ds.runtime import (PREEMPTED_EXIT_CODE, NonFiniteError, NonFiniteGuard, Preempted, PreemptionHandler,
                             is_peer_failure)
from verl_ds.runtime.nonfinite import scan_batch
from verl_ds.testing.faults import FAULT_ENV, FaultInjector, parse_faults


# --------------------------------------------------------------------------- fault grammar

def test_parse_faults_reads_every_action():
    faults = parse_faults("kill_at=after_actor:step=2 ; hang_at=step_begin:step=3-4:rank=1;"
                          "signal_at=step_begin:sig=usr1:step=5;nan_logits_at_step=3,7-8:rank=1:sample=2:pos=4:phase=update")
    kill, hang, sig, nan = faults
    assert (kill.action, kill.point, kill.steps, kill.rank) == ("kill", "after_actor", {2}, None)
    assert (hang.action, hang.steps, hang.rank) == ("hang", {3, 4}, 1)
    assert (sig.action, sig.options["sig"], sig.steps) == ("signal", "USR1", {5})
    assert (nan.action, nan.steps, nan.rank) == ("nan_logits", {3, 7, 8}, 1)
    assert nan.options == {"sample": 2, "pos": 4, "phase": "update"}
    default = parse_faults("nan_logits_at_step=3")[0]
    assert default.rank == 0 and default.options == {"sample": 0, "pos": 0, "phase": "rollout"}


@pytest.mark.parametrize("spec, message", [
    ("explode=now", r"expected one of kill_at=..., hang_at=..."),
    ("kill_at=after_lunch", r"unknown point 'after_lunch'; points: step_begin, after_actor"),
    ("kill_at=after_actor:steps=2", r"unknown option 'steps=2'; kill_at takes rank, step"),
    ("kill_at=after_actor:step=two", r"expected steps like 3, 3,5 or 4-6, got 'two'"),
    ("nan_logits_at_step=3:phase=backward", r"phase must be rollout, update, sampling, got 'backward'"),
    ("signal_at=step_begin:sig=HUP", r"sig must be TERM, USR1, INT or KILL, got 'HUP'"),
    ("kill_at=", r"expected one of"),
])
def test_bad_fault_specs_name_the_variable(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_faults(spec)
    assert str(info.value).startswith(FAULT_ENV)


def test_injector_only_fires_on_its_step_and_rank():
    inj = FaultInjector(parse_faults("signal_at=step_begin:sig=USR1:step=2:rank=1"), rank=0)
    handler = PreemptionHandler().install()
    try:
        inj.on_event("step_begin", 2)  # rank 0: not for us
        assert handler.received is None
        inj.rank = 1
        inj.on_event("step_begin", 1)
        assert handler.received is None
        inj.on_event("after_actor", 2)  # another point
        assert handler.received is None
        inj.on_event("step_begin", 2)
        assert handler.received == "SIGUSR1"
    finally:
        handler.uninstall()
    assert FaultInjector.from_env(0, env={}) is None


# --------------------------------------------------------------------------- preemption

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_sets_a_flag_instead_of_killing(sig):
    previous = signal.getsignal(sig)
    handler = PreemptionHandler().install()
    try:
        assert handler.stop_requested() is None
        os.kill(os.getpid(), sig)
        assert handler.stop_requested() == signal.Signals(sig).name
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing: the first one is reported
        assert handler.received == signal.Signals(sig).name
    finally:
        handler.uninstall()
    assert signal.getsignal(sig) == previous


def test_preempted_exits_with_75_and_says_why():
    exc = Preempted("SIGUSR1", 12, "/runs/x/checkpoints/global_step_12")
    assert isinstance(exc, SystemExit) and exc.code == PREEMPTED_EXIT_CODE == 75
    assert "SIGUSR1 received: stopped after step 12, checkpoint /runs/x/checkpoints/global_step_12" in exc.message
    assert "no checkpoint (no step had finished)" in Preempted("SIGTERM", 0, None).message


def test_peer_failures_are_recognised():
    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"))
    assert is_peer_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send"))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not is_peer_failure(ValueError("Timed out"))


# --------------------------------------------------------------------------- non-finite guard

def _batch(B=3, R=4):
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(4, 20, (B, 3), generator=g)
    responses = torch.randint(4, 20, (B, R), generator=g)
    lengths = torch.tensor([R, 2, 3])[:B]
    b = RolloutBatch.from_generation(prompt_ids, torch.ones(B, 3, dtype=torch.bool), responses, lengths,
                                     torch.tensor([False, True, True])[:B], pad_token_id=0,
                                     extras={"prompt": [f"p{i}" for i in range(B)]})
    for f in ("old_log_probs", "ref_log_probs", "values", "token_rewards", "advantages", "returns", "scores"):
        b[f] = torch.zeros(B, R)
    b.scores[:, 0] = torch.tensor([0.5, 1.0, 0.0])[:B]
    return b


def test_scan_batch_names_samples_positions_and_rewards():
    b = _batch()
    assert scan_batch(b) == []
    b.old_log_probs[1, 1] = float("nan")
    b.advantages[1, :] = float("inf")
    b.values[2, 3] = float("-inf")
    found = scan_batch(b, responses=["a", "b", "c"], rank=3)
    assert [(s["rank"], s["index"]) for s in found] == [(3, 1), (3, 2)]
    assert found[0]["nonfinite"] == {"old_log_probs": [1], "advantages": [0, 1, 2, 3]}
    assert found[0]["score"] == 1.0 and found[0]["prompt"] == "p1" and found[0]["response"] == "b"
    assert found[0]["response_length"] == 2 and found[0]["ended_with_eos"] is True
    assert found[1]["nonfinite"] == {"values": [3]}


def test_guard_counts_writes_records_and_stops_after_max_bad_steps(tmp_path):
    guard = NonFiniteGuard(max_bad_steps=2, run_dir=str(tmp_path))
    good, bad = _batch(), _batch()
    bad.ref_log_probs[0, 2] = float("nan")
    bad.token_rewards[0, 2] = float("nan")
    for step, batch, expect in ((1, good, False), (2, bad, True), (3, good, False), (4, bad, True), (5, bad, True)):
        guard.begin_step()
        assert guard.skip_batch(batch, planned_updates=4) is expect
        m = guard.end_step(step, batch, ["x", "y", "z"])
        assert m["training/skipped_updates"] == (4.0 if expect else 0.0)
        if step < 5:
            guard.raise_if_exhausted()
    assert m["training/nonfinite_steps"] == 3.0 and m["training/consecutive_bad_steps"] == 2.0
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps with non-finite values \(trainer.max_bad_steps=2\)"
                                             r".*Last forensic record: .*nonfinite/step_5.json") as info:
        guard.raise_if_exhausted()
    record = json.load(open(info.value.record))
    assert record["step"] == 5 and record["kind"] == "batch" and record["origin"] == "ref_log_probs"
    assert record["fields"] == {"ref_log_probs": {"samples": 1, "tokens": 1},
                                "token_rewards": {"samples": 1, "tokens": 1}}
    assert record["samples"][0]["nonfinite"] == {"ref_log_probs": [2], "token_rewards": [2]}
    assert record["samples"][0]["token_reward_sum"] == "nan" and record["samples"][0]["score"] == 0.5
    assert "reference model" in record["hint"]
    assert sorted(os.listdir(tmp_path / "nonfinite")) == ["step_2.json", "step_4.json", "step_5.json"]
    restored = NonFiniteGuard(max_bad_steps=2, run_dir=str(tmp_path))
    restored.load_state_dict(guard.state_dict())
    assert (restored.total_bad_steps, restored.consecutive) == (3, 2)
    with pytest.raises(ValueError, match=r"max_bad_steps: expected an int >= 1, got 0"):
        NonFiniteGuard(max_bad_steps=0, run_dir=str(tmp_path))


def test_a_failed_draw_skips_the_step_with_no_batch(tmp_path):
    """The rollout raised SamplingError: the trainer has no batch to check, only the error."""
    guard = NonFiniteGuard(max_bad_steps=3, run_dir=str(tmp_path))
    guard.begin_step()
    assert guard.skip_batch(None) is False  # no batch and no error: nothing to skip
    guard.sampling_error = "sampling failed: probability tensor contains either `inf`, `nan` or element < 0"
    assert guard.skip_batch(None, planned_updates=2) is True
    m = guard.end_step(7, None)
    assert (m["training/nonfinite_steps"], m["training/skipped_updates"], m["training/consecutive_bad_steps"]) == (
        1.0, 2.0, 1.0)
    record = json.load(open(tmp_path / "nonfinite" / "step_7.json"))
    assert record["kind"] == "batch" and record["origin"] == "sampling" and record["samples"] == []
    assert record["hint"].startswith("sampling failed (the next-token distribution was not a valid probability")
    assert "probability tensor contains" in record["hint"]


# --------------------------------------------------------------------------- checkpoints

def _fake_checkpoint(root, step, latest=True, manifest=True):
    """A checkpoint directory with the manifest checkpoint.save writes (files, sizes, edge digests)."""
    d = os.path.join(root, f"global_step_{step}")
    os.makedirs(os.path.join(d, "actor", "state"))
    with open(os.path.join(d, "actor", "state", "shard.pt"), "wb") as fh:
        fh.write(os.urandom(3 * (1 << 20) + 17))  # > 2 MiB: head and tail digests differ from the middle
    with open(os.path.join(d, "trainer_state.json"), "w") as fh:
        json.dump({"global_step": step}, fh)
    if manifest:
        files = ckpt._manifest(d)
        body = {"step": step, "world_size": 1, "files": files,
                "digests": {rel: ckpt.edge_digest(os.path.join(d, rel)) for rel in files}}
        ckpt.fsync_write(os.path.join(d, ckpt.MANIFEST), json.dumps(body).encode())
    if latest:
        ckpt.fsync_write(os.path.join(root, "latest"), f"global_step_{step}".encode())
    return d


def _corrupt(d, how):
    shard = os.path.join(d, "actor", "state", "shard.pt")
    if how == "truncated":
        with open(shard, "r+b") as fh:
            fh.truncate(1000)
    elif how == "tail overwritten":
        with open(shard, "r+b") as fh:
            fh.seek(-10, os.SEEK_END)
            fh.write(b"0123456789")
    elif how == "file missing":
        os.remove(shard)
    elif how == "manifest missing":
        os.remove(os.path.join(d, ckpt.MANIFEST))
    elif how == "manifest garbage":
        with open(os.path.join(d, ckpt.MANIFEST), "w") as fh:
            fh.write("{not json")


@pytest.mark.parametrize("how, reason", [
    ("truncated", r"file actor/state/shard.pt has 1000 bytes, the manifest says 3145745"),
    ("tail overwritten", r"file actor/state/shard.pt is corrupt"),
    ("file missing", r"missing file actor/state/shard.pt"),
    ("manifest missing", r"no COMPLETE manifest \(the save did not finish\)"),
    ("manifest garbage", r"unreadable COMPLETE manifest"),
])
def test_a_damaged_newest_checkpoint_is_named_and_skipped_for_the_previous(tmp_path, caplog, how, reason):
    root = str(tmp_path)
    old = _fake_checkpoint(root, 4)
    new = _fake_checkpoint(root, 6)
    assert ckpt.verify(new) is None and ckpt.find_resumable(root) == new
    _corrupt(new, how)
    assert ckpt.verify(new) is not None
    if how == "tail overwritten":  # pruning only checks sizes; resuming re-hashes the ends of every file
        assert ckpt.verify(new, digests=False) is None
    with caplog.at_level(logging.WARNING, logger="verl_ds.checkpoint"):
        assert ckpt.find_resumable(root) == old
    assert any(f"skipping checkpoint {new}: " in r.message and re.search(reason, r.message)
               for r in caplog.records), [r.message for r in caplog.records]
    with pytest.raises(ckpt.CheckpointError, match=f"cannot resume from {new}: "):
        ckpt.load(new, {"actor": None})


def test_newer_directories_than_latest_are_reported(tmp_path, caplog):
    root = str(tmp_path)
    used = _fake_checkpoint(root, 2)
    complete_not_latest = _fake_checkpoint(root, 3, latest=False)
    partial = _fake_checkpoint(root, 4, latest=False, manifest=False)
    with caplog.at_level(logging.WARNING, logger="verl_ds.checkpoint"):
        assert ckpt.find_resumable(root) == used
    text = "\n".join(r.message for r in caplog.records)
    assert f"skipping checkpoint {partial}: no COMPLETE manifest" in text
    assert f"skipping checkpoint {complete_not_latest}: complete, but 'latest' was not updated to it" in text


def test_latest_naming_a_missing_directory_falls_back(tmp_path, caplog):
    root = str(tmp_path)
    d = _fake_checkpoint(root, 1)
    ckpt.fsync_write(os.path.join(root, "latest"), b"global_step_9")
    with caplog.at_level(logging.WARNING, logger="verl_ds.checkpoint"):
        assert ckpt.find_resumable(root) == d
    assert "global_step_9 named by 'latest' does not exist" in caplog.text
    assert ckpt.find_resumable(str(tmp_path / "nothing")) is None
    with pytest.raises(ckpt.CheckpointError, match=r"'/x/step_3' is not a checkpoint directory"):
        ckpt.step_of("/x/step_3")
