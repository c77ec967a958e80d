"""Issue 31 item 9: a run built without a reference model (algo.kl_coef=0, algo.kl_ctrl=fixed) cannot turn a KL
term on over PATCH /v1/state: 400 naming the missing reference, nothing staged. Real server on 127.0.0.1."""
from server_testutil import TOKEN, call, make_registry

from verl_ds.config import load_config
from verl_ds.server import ControlServer
from verl_ds.state import SharedState


def _serve(overrides):
    state = SharedState.from_config(load_config(None, overrides), rank=0)
    return state, ControlServer(state, make_registry(), port=0, token=TOKEN)


def test_kl_keys_on_a_run_without_a_reference_are_400_and_nothing_is_staged(monkeypatch):
    monkeypatch.delenv("VERL_DS_SERVER_TOKEN", raising=False)
    state, server = _serve(["algo.kl_coef=0", "algo.kl_ctrl=fixed"])
    with server:
        for body in ({"kl_coef": 0.1, "use_kl_penalty": True}, {"kl_coef": 0.1}, {"kl_ctrl_type": "band"},
                     {"use_kl_penalty": True, "temperature": 0.5}):
            a = call(server.url, "PATCH", "/v1/state", body, token=TOKEN)
            assert a.status == 400, (body, a)
            kl_keys = sorted(k for k in body if k != "temperature")
            assert sorted(a.json["errors"]) == kl_keys, a.json
            for key in kl_keys:
                assert "this run has no reference model (it started with algo.kl_coef=0 and algo.kl_ctrl=fixed), " \
                       "so no KL term can be turned on" in a.json["errors"][key], a.json
        assert state.staged() == []
        # what keeps the KL term off is still accepted, and so is any other key
        ok = call(server.url, "PATCH", "/v1/state", {"kl_coef": 0.0, "use_kl_penalty": False, "temperature": 0.5},
                  token=TOKEN)
        assert ok.status == 202, ok
    assert state.get("use_kl_penalty") is False and state.get("kl_coef") == 0.0


def test_the_same_patch_is_staged_on_a_run_with_a_reference(monkeypatch):
    monkeypatch.delenv("VERL_DS_SERVER_TOKEN", raising=False)
    state, server = _serve(["algo.kl_coef=0.01", "algo.kl_ctrl=fixed"])
    with server:
        a = call(server.url, "PATCH", "/v1/state", {"kl_coef": 0.1, "use_kl_penalty": True}, token=TOKEN)
        assert a.status == 202 and a.json["staged"] == {"kl_coef": 0.1, "use_kl_penalty": True}, a
