"""verl_ds.safe_state: the trainer and RNG states round-trip bit for bit through JSON + safetensors, what cannot be
stored as data is refused at save time by path, and an old pickle is read by the restricted unpickler only."""
import math
import os
import random

import numpy as np
import pytest
import torch

from verl_ds import safe_state


def _write(path, data):
    with open(path, "wb") as fh:
        fh.write(data)


def test_rng_states_round_trip_and_continue_the_same_draws(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.random(), np.random.normal(), torch.rand(3)  # a cached gaussian, mid-stream positions
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = (random.random(), np.random.rand(), torch.rand(2).tolist())
    paths = safe_state.dump(state, str(tmp_path / "rng.json"), _write)
    assert [os.path.basename(p) for p in paths] == ["rng.safetensors", "rng.json"]
    back = safe_state.load(str(tmp_path / "rng.json"))
    random.setstate(back["python"]), np.random.set_state(back["numpy"]), torch.set_rng_state(back["torch"])
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == expected


def test_plain_values_are_exact_and_lookalike_dicts_survive(tmp_path):
    state = {"lr": 0.1 + 0.2, "tiny": 5e-324, "inf": math.inf, "big": 2**70, "none": None, "flag": True,
             "pair": (1, (2.5, "x")), "list": [1, [2]], "tagged": {"__tuple__": [1]}, "t": torch.arange(5.0) / 3}
    safe_state.dump(state, str(tmp_path / "s.json"), _write)
    back = safe_state.load(str(tmp_path / "s.json"))
    t = back.pop("t")
    assert torch.equal(t, torch.arange(5.0) / 3)
    assert back == {k: v for k, v in state.items() if k != "t"}
    assert isinstance(back["pair"], tuple) and isinstance(back["pair"][1], tuple)
    nan = safe_state.encode({"x": math.nan})[0]
    assert math.isnan(safe_state._decode(__import__("json").loads(nan), {})["x"])


def test_what_is_not_data_is_refused_by_path():
    with pytest.raises(TypeError, match=r"state\.models\.ppo\.ctrl: a value of type object cannot be saved as data"):
        safe_state.encode({"models": {"ppo": {"ctrl": object()}}})
    with pytest.raises(TypeError, match=r"state\.m: dict keys must be strings to be saved as JSON, got 3"):
        safe_state.encode({"m": {3: "x"}})


def test_an_old_pickle_is_read_as_data_and_a_payload_is_refused(tmp_path):
    good = tmp_path / "old.pt"
    torch.save({"global_step": 3, "numpy": np.random.get_state(), "t": torch.ones(2)}, good)
    back = safe_state.load_legacy_pickle(str(good))
    assert back["global_step"] == 3 and back["numpy"][1].dtype == np.uint32

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"global_step": Payload()}, evil)
    with pytest.raises(safe_state.UnsafeStateError, match=r"evil\.pt cannot be read as data only \(UnpicklingError: "
                                                          r".*GLOBAL posix\.system"):
        safe_state.load_legacy_pickle(str(evil))
    assert not marker.exists()
