"""Every route of the control server, answered over real HTTP on 127.0.0.1."""
import json
import os

from server_testutil import TOKEN, call, default, range_text

from verl_ds.server import URL_FILE
from verl_ds.state import HOT_KEYS, STATE_KEYS


def test_start_writes_url_file_and_stop_removes_it(server, parts):
    path = os.path.join(parts["run_dir"], URL_FILE)
    with open(path) as fh:
        assert fh.read().strip() == server.url
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    server.stop()
    assert not os.path.exists(path)
    server.stop()  # idempotent


def test_stop_is_idempotent_and_keeps_a_url_file_that_is_not_ours(parts):
    from verl_ds.server import ControlServer

    srv = ControlServer(parts["state"], parts["registry"], port=0, run_dir=parts["run_dir"])
    srv.stop()  # never started: nothing to do
    srv.start()
    path = os.path.join(parts["run_dir"], URL_FILE)
    with open(path, "w") as fh:  # another server took over the run directory since
        fh.write("http://127.0.0.1:1\n")
    srv.stop()
    srv.stop()
    with open(path) as fh:
        assert fh.read() == "http://127.0.0.1:1\n"


def test_healthz(server, parts):
    parts["state"].set("global_step", 7)
    a = call(server.url, "GET", "/healthz")
    assert a.status == 200 and a.headers["content-type"] == "application/json"
    assert a.json["status"] == "ok" and a.json["global_step"] == 7 and a.json["mutations"] == "enabled"
    head = call(server.url, "HEAD", "/healthz")
    assert head.status == 200 and head.raw == b"" and int(head.headers["content-length"]) > 0


def test_models_list_has_openai_shape_and_verl_ds_fields(server, parts):
    parts["state"].set("global_step", 3)
    a = call(server.url, "GET", "/v1/models")
    assert a.status == 200
    body = a.json
    assert body["object"] == "list" and body["global_step"] == 3
    assert body["state"] == parts["state"].snapshot() and set(body["state"]) == set(STATE_KEYS)
    by_id = {m["id"]: m for m in body["data"]}
    assert sorted(by_id) == ["actor", "ref", "reward"]
    for m in body["data"]:
        assert m["object"] == "model" and m["owned_by"] == "verl_ds" and isinstance(m["created"], int)
    assert by_id["actor"] == {**by_id["actor"], "role": "actor", "aliases": ["policy", "ppo_actor"], "class": "Linear",
                              "version": 1, "trainable": True, "num_parameters": 15}
    assert by_id["ref"]["trainable"] is False and by_id["ref"]["num_parameters"] == 6 and by_id["ref"]["role"] == "ref"
    assert by_id["reward"]["class"] == "Box" and by_id["reward"]["num_parameters"] is None


def test_models_list_follows_hot_swap(server, parts):
    from server_testutil import Box

    parts["registry"].register("reward", Box())
    entry = {m["id"]: m for m in call(server.url, "GET", "/v1/models").json["data"]}["reward"]
    assert entry["version"] == 2


def test_model_by_name_and_alias(server):
    by_name = call(server.url, "GET", "/v1/models/actor")
    by_alias = call(server.url, "GET", "/v1/models/ppo_actor")
    assert by_name.status == by_alias.status == 200
    assert by_name.json["id"] == by_alias.json["id"] == "actor"
    assert by_alias.json["num_parameters"] == 15
    assert call(server.url, "GET", "/v1/models/reward_model").json["id"] == "reward"
    assert call(server.url, "GET", "/v1/models/actor/").json["id"] == "actor"  # a trailing slash is fine


def test_model_unknown_is_404_with_suggestions(server):
    a = call(server.url, "GET", "/v1/models/actr")
    assert a.status == 404
    # the id sent is not repeated back (an answer before authentication echoes nothing the client sent)
    assert a.json["error"] == "no model is registered under the requested id; did you mean 'actor' or 'ppo_actor'?"
    assert a.json["suggestions"] == ["actor", "ppo_actor"] and a.json["models"] == ["actor", "ref", "reward"]
    b = call(server.url, "GET", "/v1/models/reward_model_v2")
    assert b.status == 404 and "reward_model" in b.json["suggestions"]
    c = call(server.url, "GET", "/v1/models/zzz")
    assert c.status == 404 and c.json["suggestions"] == []
    assert c.json["error"] == "no model is registered under the requested id"


def test_state_get_has_values_schema_version(server, parts):
    st = parts["state"]
    st.set("kl_coef", 0.02)
    a = call(server.url, "GET", "/v1/state")
    assert a.status == 200
    assert a.json["values"] == st.snapshot() and a.json["version"] == st.version == 1
    schema = a.json["schema"]
    assert set(schema) == set(STATE_KEYS)
    assert schema["kl_coef"] == {**schema["kl_coef"], "type": "float", "range": [0.0, 1000.0], "hot": True}
    assert schema["global_step"]["hot"] is False
    assert sum(s["hot"] for s in schema.values()) == len(HOT_KEYS) == 18
    assert all(s["description"] for s in schema.values())
    assert a.json["pending"] == []


def test_state_key_get_and_unknown_key(server):
    a = call(server.url, "GET", "/v1/state/temperature")
    assert a.status == 200 and a.json["key"] == "temperature" and a.json["value"] == default("temperature")
    assert a.json["schema"]["range_text"] == range_text("temperature")
    b = call(server.url, "GET", "/v1/state/temprature")
    assert b.status == 404 and b.json["suggestions"] == ["temperature"]
    assert b.json["error"].startswith("unknown SharedState key; did you mean 'temperature'? (valid keys: [")
    assert "temprature" not in b.text


def test_patch_stages_then_applies_at_announced_step(server, parts):
    st = parts["state"]
    st.set("global_step", 4)
    a = call(server.url, "PATCH", "/v1/state", {"kl_coef": 0.05, "temperature": 0.7, "top_k": 5}, token=TOKEN)
    assert a.status == 202, a
    assert a.json == {"staged": {"kl_coef": 0.05, "temperature": 0.7, "top_k": 5}, "applies_at_step": 5,
                      "status": "staged"}
    assert st.get("kl_coef") == default("kl_coef")  # staged, not yet applied
    pending = call(server.url, "GET", "/v1/state").json["pending"]
    assert [(p["key"], p["value"], p["client"]) for p in pending] == [
        ("kl_coef", 0.05, "127.0.0.1"), ("temperature", 0.7, "127.0.0.1"), ("top_k", 5, "127.0.0.1")]
    records = st.apply_staged()  # what the trainer does at the step boundary
    assert [(r["key"], r["old"], r["new"], r["client"]) for r in records] == [
        ("kl_coef", default("kl_coef"), 0.05, "127.0.0.1"), ("temperature", default("temperature"), 0.7, "127.0.0.1"),
        ("top_k", default("top_k"), 5, "127.0.0.1")]
    values = call(server.url, "GET", "/v1/state").json["values"]
    assert values["kl_coef"] == 0.05 and values["temperature"] == 0.7 and values["top_k"] == 5


def test_patch_int_for_float_is_normalised(server, parts):
    a = call(server.url, "PATCH", "/v1/state", {"gamma": 1}, token=TOKEN)
    assert a.status == 202 and a.json["staged"] == {"gamma": 1.0} and isinstance(a.json["staged"]["gamma"], float)


def test_reward_swap_stages_through_the_swapper(server, parts, rm_in_dir):
    parts["state"].set("global_step", 9)
    a = call(server.url, "POST", "/v1/models/reward", {"function": "exact_match"}, token=TOKEN)
    assert a.status == 202, a
    assert a.json == {"staged": {"functions": [{"name": "exact_match", "weight": 1.0, "per_token": False}],
                                 "model_path": None, "model_weight": None}, "applies_at_step": 10, "status": "staged"}
    b = call(server.url, "POST", "/v1/models/reward",
             {"functions": [{"name": "parity", "weight": 0.5}, {"name": "exact_match", "weight": 0.5}]}, token=TOKEN)
    assert b.status == 202
    assert b.json["staged"]["functions"] == [{"name": "parity", "weight": 0.5, "per_token": False},
                                             {"name": "exact_match", "weight": 0.5, "per_token": False}]
    c = call(server.url, "POST", "/v1/models/reward", {"model_path": rm_in_dir, "model_weight": 2}, token=TOKEN)
    assert c.status == 202, c
    assert c.json["staged"] == {"functions": [], "model_path": os.path.realpath(rm_in_dir), "model_weight": 2.0}
    swaps = parts["swapper"].staged
    assert len(swaps) == 3 and swaps[0]["client"] == "127.0.0.1"
    assert swaps[2]["model_path"] == os.path.realpath(rm_in_dir)


def test_reward_swap_bad_request_is_400_with_message(server, parts):
    a = call(server.url, "POST", "/v1/models/reward", {"function": "exact_mach"}, token=TOKEN)
    assert a.status == 400
    assert "unknown reward function 'exact_mach'" in a.json["error"] and "exact_match" in a.json["error"]
    missing = os.path.join(parts["rm_dir"], "no_such_model")
    b = call(server.url, "POST", "/v1/models/reward", {"model_path": missing}, token=TOKEN)
    assert b.status == 400 and b.json["error"] == f"reward swap: model_path {missing!r} is not a local directory"
    c = call(server.url, "POST", "/v1/models/reward", {"model_path": "/no/such/dir"}, token=TOKEN)
    assert c.status == 400 and c.json["error"].startswith("reward swap: model_path '/no/such/dir' resolves to "
                                                          "'/no/such/dir', outside the reward model directory")
    assert parts["swapper"].staged == []


def test_metrics_prometheus_text(server, parts):
    st = parts["state"]
    st.update({"global_step": 2, "kl_coef": 0.03, "use_kl_penalty": False, "kl_kind": "k3"})
    parts["metrics"].log(2, {"actor/pg_loss": -0.25, "critic/score/mean": 0.5, "note": "text is skipped"})
    a = call(server.url, "GET", "/metrics")
    assert a.status == 200 and a.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = dict(line.rsplit(" ", 1) for line in a.text.splitlines() if line and not line.startswith("#"))
    assert float(samples["verl_ds_actor_pg_loss"]) == -0.25
    assert float(samples["verl_ds_critic_score_mean"]) == 0.5
    assert samples["verl_ds_step"] == "2"
    assert float(samples["verl_ds_state_kl_coef"]) == 0.03
    assert samples["verl_ds_state_global_step"] == "2" and samples["verl_ds_state_use_kl_penalty"] == "0"
    assert "verl_ds_state_best_reward" not in samples  # None before the first evaluation
    assert not any("note" in k for k in samples)
    info = next(k for k in samples if k.startswith("verl_ds_state_info{"))
    assert 'kl_kind="k3"' in info and f'kl_ctrl_type="{default("kl_ctrl_type")}"' in info
    assert "# TYPE verl_ds_actor_pg_loss gauge" in a.text


def test_query_string_is_ignored(server):
    assert call(server.url, "GET", "/v1/models?limit=1").status == 200


def test_keep_alive_serves_several_requests_on_one_connection(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        for path in ("/healthz", "/v1/state", "/v1/models", "/nope", "/healthz"):
            conn.request("GET", path)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == (404 if path == "/nope" else 200), body
        conn.request("PATCH", "/v1/state", body=b'{"lam": 0.9}', headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        assert resp.status == 202 and json.loads(resp.read())["staged"] == {"lam": 0.9}
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
