"""`verl-ds state get|set` (verl_ds.client.main) against a real server."""
import json
import os

import pytest
from server_testutil import TOKEN, default, range_text

from verl_ds import client
from verl_ds.client import ClientError, parse_assignments, resolve_url
from verl_ds.server import TOKEN_ENV, URL_FILE


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(client.URL_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def run(capsys, *argv):
    code = client.main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_get_all_by_run_dir(server, parts, capsys):
    parts["state"].set("global_step", 3)
    code, out, err = run(capsys, "--run-dir", str(parts["run_dir"]), "get")
    assert code == 0 and err == ""
    assert out["values"] == parts["state"].snapshot() and out["global_step"] == 3 and "schema" not in out
    code, out, _ = run(capsys, "--url", server.url, "get", "--schema")
    assert code == 0 and out["schema"]["kl_coef"]["hot"] is True


def test_get_one_key_and_unknown_key(server, capsys):
    code, out, _ = run(capsys, "--url", server.url, "get", "kl_coef")
    assert code == 0 and out["key"] == "kl_coef" and out["value"] == default("kl_coef")
    assert out["schema"]["type"] == "float"
    code, out, err = run(capsys, "--url", server.url, "get", "kl_coeff")
    assert code == 1 and out is None
    assert "HTTP 404: unknown SharedState key; did you mean 'kl_coef'?" in err


def test_set_stages_updates_with_token_from_env(server, parts, capsys, monkeypatch):
    monkeypatch.setenv(client.URL_ENV, server.url)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    parts["state"].set("global_step", 11)
    code, out, err = run(capsys, "set", "kl_coef=0.05", "kl_kind=k3", "use_kl_penalty=false", "top_k=4")
    assert code == 0, err
    assert out == {"staged": {"kl_coef": 0.05, "kl_kind": "k3", "use_kl_penalty": False, "top_k": 4},
                   "applies_at_step": 12, "status": "staged"}
    parts["state"].apply_staged()
    assert parts["state"].get("kl_kind") == "k3" and parts["state"].get("use_kl_penalty") is False


def test_set_refused_prints_server_message_and_every_key(server, parts, capsys):
    code, out, err = run(capsys, "--url", server.url, "--token", TOKEN, "set", "temperature=0", "global_step=3")
    assert code == 1 and out is None
    assert "HTTP 400: SharedState refused 2 key(s)" in err
    errors = json.loads(err[err.index("{"):])["errors"]
    assert errors["temperature"] == f"0.0 is out of range {range_text('temperature')}"
    assert errors["global_step"].startswith("read-only at run time")
    assert parts["state"].staged() == []


def test_set_without_token_is_401(server, capsys):
    code, _, err = run(capsys, "--url", server.url, "set", "lam=0.9")
    assert code == 1 and "HTTP 401: missing 'Authorization: Bearer <token>' header" in err


def test_no_url_anywhere_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/default/server_url.txt here
    code, _, err = run(capsys, "get")
    assert code == 2
    assert "no server URL" in err and "--url" in err and client.URL_ENV in err
    code, _, err = run(capsys, "--run-dir", str(tmp_path / "nope"), "get")
    assert code == 2 and f"{URL_FILE}' does not exist" in err


def test_unreachable_server(capsys, tmp_path):
    import socket

    with socket.socket() as s:  # a port that is free now and nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run(capsys, "--url", f"http://127.0.0.1:{port}", "--timeout", "2", "get")
    assert code == 1 and f"cannot reach the control server at http://127.0.0.1:{port}" in err


def test_bad_arguments(capsys):
    assert client.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert client.main(["--url", "http://x", "set", "novalue"]) == 2
    assert "set: expected KEY=VALUE, got 'novalue'" in capsys.readouterr().err


def test_parse_assignments_and_resolve_url(tmp_path, monkeypatch):
    assert parse_assignments(["a=1", "b=0.5", "c=true", "d=null", "e=k3", "f=", "g=x=y"]) == {
        "a": 1, "b": 0.5, "c": True, "d": None, "e": "k3", "f": "", "g": "x=y"}
    with pytest.raises(ClientError, match="set: key 'a' given twice"):
        parse_assignments(["a=1", "a=2"])
    with pytest.raises(ClientError, match="set: expected KEY=VALUE, got '=3'"):
        parse_assignments(["=3"])
    with pytest.raises(ClientError, match="set: give at least one KEY=VALUE"):
        parse_assignments([])
    (tmp_path / URL_FILE).write_text("http://127.0.0.1:1234\n")
    monkeypatch.setenv(client.URL_ENV, "http://env:1/")
    assert resolve_url("http://flag:2/", str(tmp_path)) == "http://flag:2"
    assert resolve_url(None, str(tmp_path)) == "http://127.0.0.1:1234"
    assert resolve_url(None, None) == "http://env:1"
    monkeypatch.delenv(client.URL_ENV)
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/default")
    (tmp_path / "runs" / "default" / URL_FILE).write_text("http://127.0.0.1:9\n")
    assert resolve_url(None, None) == "http://127.0.0.1:9"
