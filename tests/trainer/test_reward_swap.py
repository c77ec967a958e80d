"""Reward swap requests (POST /v1/models/reward) are validated in full before anything is staged."""
import pytest

from verl_ds.rewards import parse_reward_swap


def test_valid_requests_are_normalised(tmp_path):
    assert parse_reward_swap({"function": "parity"}) == {"functions": [{"name": "parity"}], "model_path": None,
                                                         "model_weight": None}
    out = parse_reward_swap({"functions": ["exact_match", {"name": "parity", "weight": 0.5, "per_token": False}],
                             "model_path": str(tmp_path), "model_weight": 2})
    assert [f["name"] for f in out["functions"]] == ["exact_match", "parity"]
    assert out["model_path"] == str(tmp_path) and out["model_weight"] == 2


@pytest.mark.parametrize("spec, message", [
    ([1, 2], r"expected a JSON object, got list"),
    ({"fn": "parity"}, r"unknown field\(s\) \['fn'\]"),
    ({}, r"give 'function', 'functions' or 'model_path'"),
    ({"functions": "parity"}, r"functions: expected a list, got str"),
    ({"functions": [3]}, r"functions\[0\]: expected a name or"),
    ({"functions": [{"name": "parity", "w": 1}]}, r"functions\[0\]: expected a name or"),
    ({"functions": [{"name": "parity", "weight": "high"}]}, r"functions\[0\].weight: expected a number"),
    ({"function": "parityy"}, r"unknown reward function 'parityy'.*Did you mean 'parity'"),
    ({"function": "no_such_module_xyz:fn"}, r"module 'no_such_module_xyz' not found"),
    ({"model_path": "/no/such/dir"}, r"model_path '/no/such/dir' is not a local directory"),
    ({"function": "parity", "model_weight": True}, r"model_weight: expected a number"),
])
def test_bad_requests_name_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_reward_swap(spec)
