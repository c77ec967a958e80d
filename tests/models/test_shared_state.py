"""SharedState: declared keys, validation messages, staging, persistence, thread safety (one process)."""
import json
import threading

import pytest

from verl_ds.algos import KL_KINDS
from verl_ds.state import HOT_KEYS, STATE_KEYS, SharedState, StateValidationError, UnknownStateKeyError

EXPECTED_HOT = {"actor_lr", "critic_lr", "kl_coef", "target_kl", "kl_ctrl_type", "use_kl_penalty", "kl_kind",
                "clip_ratio_low", "clip_ratio_high", "cliprange_value", "entropy_coef", "gamma", "lam", "temperature",
                "top_k", "top_p", "max_new_tokens", "max_staleness"}


def test_declared_keys_and_schema():
    assert set(HOT_KEYS) == EXPECTED_HOT and len(HOT_KEYS) == 18
    for ro in ("global_step", "epoch", "actor_version", "reward_version", "best_reward", "reward_name"):
        assert not STATE_KEYS[ro].hot
    s = SharedState(rank=0)
    schema = s.schema()
    assert schema["kl_ctrl_type"]["choices"] == ["fixed", "band", "ziegler"]
    assert schema["kl_kind"]["choices"] == list(KL_KINDS)
    assert schema["temperature"]["range_text"] == "[0.01, 100.0]"  # logits / temperature stays finite
    assert schema["clip_ratio_low"]["range_text"] == "[0.0, 1.0)"  # 1 - low must stay > 0
    assert schema["top_k"]["range_text"] == "[0, inf)"
    assert schema["top_k"] == {**schema["top_k"], "type": "int", "hot": True, "range": [0, None]}
    for key, d in schema.items():
        assert d["description"], key
        assert s.get(key) == d["default"]
    json.dumps(schema)
    json.dumps(s.snapshot())


def test_get_unknown_key_suggests():
    with pytest.raises(UnknownStateKeyError, match=r"unknown SharedState key 'kl_coeff'; did you mean 'kl_coef'"):
        SharedState(rank=0).get("kl_coeff")


def test_set_validates_and_bumps_version_on_change():
    s = SharedState(rank=0)
    v0 = s.version
    s.set("global_step", 5)  # read-only keys are writable by the trainer
    s.set("actor_lr", 1)  # int accepted for float, stored as float
    assert s["global_step"] == 5 and s["actor_lr"] == 1.0 and isinstance(s["actor_lr"], float)
    assert s.version == v0 + 2
    s.set("global_step", 5)  # no change, no bump
    assert s.version == v0 + 2
    s.set("best_reward", 0.5)
    s.set("best_reward", None)  # nullable
    with pytest.raises(StateValidationError, match=r"top_k: expected int, got bool True"):
        s.set("top_k", True)
    with pytest.raises(StateValidationError, match=r"gamma: 1.5 is out of range \[0.0, 1.0\]"):
        s.update({"gamma": 1.5})
    with pytest.raises(StateValidationError, match=r"clip_ratio_low: 1.0 is out of range \[0.0, 1.0\)"):
        s.set("clip_ratio_low", 1.0)


def test_write_on_other_rank_refused():
    s = SharedState(rank=1)
    with pytest.raises(RuntimeError, match=r"SharedState.set/update called on rank 1: only rank 0 mutates"):
        s.set("kl_coef", 0.1)
    with pytest.raises(RuntimeError, match="SharedState.stage called on rank 1"):
        s.stage({"kl_coef": 0.1})
    assert s.apply_staged() == []


def test_stage_reports_every_bad_key_and_applies_nothing():
    s = SharedState(rank=0)
    before = s.snapshot()
    with pytest.raises(StateValidationError) as info:
        s.stage({"kl_coef": 0.05, "klcoef": 1.0, "global_step": 3, "top_k": 2.5, "use_kl_penalty": 1,
                 "temperature": 0.0, "kl_ctrl_type": "pid", "top_p": float("nan")})
    errors = info.value.errors
    assert set(errors) == {"klcoef", "global_step", "top_k", "use_kl_penalty", "temperature", "kl_ctrl_type", "top_p"}
    assert "did you mean 'kl_coef'" in errors["klcoef"] and "Valid keys" in errors["klcoef"]
    assert errors["global_step"].startswith("read-only at run time")
    assert errors["top_k"] == "expected int, got float 2.5"
    assert errors["use_kl_penalty"] == "expected bool (true/false), got int 1"
    assert errors["temperature"] == "0.0 is out of range [0.01, 100.0]"
    assert errors["kl_ctrl_type"] == "'pid' is not one of ['fixed', 'band', 'ziegler']"
    assert errors["top_p"] == "expected a finite float, got nan"
    assert isinstance(info.value, ValueError)
    assert s.staged() == [] and s.snapshot() == before


def test_stage_then_apply_at_boundary():
    s = SharedState(rank=0)
    s.set("global_step", 7)
    out = s.stage({"kl_coef": 0.2, "top_k": 40}, client="alice")
    assert out == {"staged": {"kl_coef": 0.2, "top_k": 40}, "applies_at_step": 8}
    assert s["kl_coef"] == 0.01  # not yet applied (the config's default)
    s.stage({"kl_coef": 0.3}, client="bob")
    v = s.version
    records = s.apply_staged()
    assert [(r["key"], r["old"], r["new"], r["client"]) for r in records] == [
        ("kl_coef", 0.01, 0.2, "alice"), ("top_k", 0, 40, "alice"), ("kl_coef", 0.2, 0.3, "bob")]
    assert all(isinstance(r["staged_at"], float) for r in records)
    assert s["kl_coef"] == 0.3 and s.version == v + 3
    assert s.apply_staged() == []


def test_state_dict_roundtrip_through_json():
    s = SharedState(rank=0)
    s.update({"global_step": 12, "kl_coef": 0.123, "best_reward": 0.75, "reward_name": "parity", "kl_kind": "k3"})
    t = SharedState(rank=1)  # loading a checkpoint is allowed on every rank
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.snapshot() == s.snapshot() and t.version == s.version
    s.set("global_step", 13)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t["global_step"] == 13


def test_load_state_dict_rejects_bad_states():
    s = SharedState(rank=0)
    with pytest.raises(StateValidationError, match=r"gamma: expected float, got str 'x'"):
        s.load_state_dict({"values": {"gamma": "x"}, "version": 1})
    with pytest.raises(StateValidationError, match="unknown SharedState key 'old_key'"):
        s.load_state_dict({"values": {"old_key": 1}, "version": 1})
    with pytest.raises(ValueError, match="expects a dict with 'values'"):
        s.load_state_dict({"gamma": 1.0})
    assert s.snapshot() == SharedState(rank=0).snapshot()
    s.load_state_dict({"values": {"gamma": 0.9}, "version": 4})  # missing keys keep defaults
    assert s["gamma"] == 0.9 and s["lam"] == 0.95 and s.version == 4


def test_sync_without_process_group_is_noop():
    s = SharedState()
    assert s.rank == 0
    s.sync()


def test_stage_from_threads_while_applying():
    s = SharedState(rank=0)
    n_threads, per_thread = 8, 50

    def client(i):
        for j in range(per_thread):
            s.stage({"top_k": i * 1000 + j}, client=f"c{i}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_threads)]
    records = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        records += s.apply_staged()
    for t in threads:
        t.join()
    records += s.apply_staged()
    assert len(records) == n_threads * per_thread
    for i in range(n_threads):  # each client's updates apply in its own order
        mine = [r["new"] for r in records if r["client"] == f"c{i}"]
        assert mine == [i * 1000 + j for j in range(per_thread)]
    assert s["top_k"] == records[-1]["new"]


def test_state_dict_is_json_with_null_best_reward():
    data = json.loads(json.dumps(SharedState(rank=0).state_dict(), allow_nan=False))
    assert data["values"]["best_reward"] is None and data["format"] == 1


def test_more_validation_messages():
    s = SharedState(rank=0)
    with pytest.raises(TypeError, match="updates must be a dict of key -> value, got list"):
        s.update([("kl_coef", 0.1)])
    with pytest.raises(StateValidationError, match=r"reward_name: expected str, got int 3"):
        s.set("reward_name", 3)
    with pytest.raises(StateValidationError, match=r"kl_coef: expected float, got None"):
        s.set("kl_coef", None)
    with pytest.raises(StateValidationError, match=r"kl_kind: 'k9' is not one of \['k1'"):
        s.stage({"kl_kind": "k9"})
    with pytest.raises(ValueError, match=r"'version' must be an int >= 0, got -1"):
        s.load_state_dict({"values": {}, "version": -1})
    err = StateValidationError({"a": "x", "b": "y"})
    assert str(err) == "SharedState refused 2 key(s): a: x; b: y" and err.errors == {"a": "x", "b": "y"}
