"""Every error answer of the control server, its safety rules, and robustness against bad clients."""
import json
import logging
import socket
import threading

import pytest
from server_testutil import TOKEN, RawReader, call, default, dropped, make_registry, range_text, raw_exchange

from verl_ds.server import TOKEN_ENV, ControlServer, is_loopback
from verl_ds.state import SharedState


# ---- authentication -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,body", [("PATCH", "/v1/state", {"kl_coef": 0.1}),
                                              ("POST", "/v1/models/reward", {"function": "parity"})])
def test_mutations_need_the_right_bearer_token(server, parts, method, path, body):
    missing = call(server.url, method, path, body)
    assert missing.status == 401 and missing.headers["www-authenticate"] == 'Bearer realm="verl_ds"'
    assert missing.json["error"] == "missing 'Authorization: Bearer <token>' header"
    wrong = call(server.url, method, path, body, token="not-it")
    assert wrong.status == 401 and wrong.json["error"] == "invalid token"
    prefix = call(server.url, method, path, body, token=TOKEN[:-1])
    assert prefix.status == 401
    longer = call(server.url, method, path, body, token=TOKEN + "x")
    assert longer.status == 401
    scheme = call(server.url, method, path, body, headers={"Authorization": f"Basic {TOKEN}"})
    assert scheme.status == 401 and scheme.json["error"] == "Authorization header must be 'Bearer <token>'"
    assert parts["state"].staged() == [] and parts["swapper"].staged == []
    ok = call(server.url, method, path, body, token=TOKEN)
    assert ok.status == 202


def test_token_comparison_is_constant_time(server, monkeypatch):
    import hmac

    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert call(server.url, "PATCH", "/v1/state", {"lam": 0.9}, token="guess").status == 401
    assert seen == [(b"guess", TOKEN.encode())]


def test_no_token_configured_answers_403_with_how_to_enable(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=None) as srv:
        a = call(srv.url, "PATCH", "/v1/state", {"kl_coef": 0.1}, token="anything")
        assert a.status == 403
        assert "no token is configured" in a.json["error"] and "server.token=<secret>" in a.json["error"]
        assert TOKEN_ENV in a.json["error"]
        b = call(srv.url, "POST", "/v1/models/reward", {"function": "parity"})
        assert b.status == 403
        assert call(srv.url, "GET", "/healthz").json["mutations"] == "disabled"
        assert call(srv.url, "GET", "/v1/state").status == 200  # reads stay open
    assert parts["state"].staged() == []


def test_token_from_environment(parts, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, " from-env\n")  # a file-read token keeps its newline; it is stripped
    with ControlServer(parts["state"], parts["registry"], port=0) as srv:
        assert call(srv.url, "PATCH", "/v1/state", {"lam": 0.9}, token="from-env").status == 202
        assert call(srv.url, "PATCH", "/v1/state", {"lam": 0.9}, token=TOKEN).status == 401


def test_read_only_server_refuses_mutations_even_with_a_token(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, read_only=True) as srv:
        a = call(srv.url, "PATCH", "/v1/state", {"lam": 0.9}, token=TOKEN)
        assert a.status == 403 and "read-only" in a.json["error"]


# ---- start-up safety -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3"])
def test_non_loopback_bind_without_token_is_refused(parts, host):
    with pytest.raises(ValueError, match=rf"refusing to bind non-loopback host '{host}' with mutating routes "
                                         r"enabled and no token.*server\.token=<secret>.*server\.host=127\.0\.0\.1"):
        ControlServer(parts["state"], parts["registry"], host=host, port=0, token=None)


def test_non_loopback_bind_is_allowed_with_a_token_or_read_only(parts):
    ControlServer(parts["state"], parts["registry"], host="0.0.0.0", port=0, token=TOKEN)
    ControlServer(parts["state"], parts["registry"], host="0.0.0.0", port=0, token=None, read_only=True)
    ControlServer(parts["state"], parts["registry"], host="localhost", port=0, token=None)


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.10") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")
    assert not is_loopback("192.168.1.4") and not is_loopback("no-such-host.invalid")


def test_constructor_argument_errors(parts):
    st, reg = parts["state"], parts["registry"]
    with pytest.raises(TypeError, match="state must be a SharedState, got dict"):
        ControlServer({}, reg)
    with pytest.raises(TypeError, match="registry must be a ModelRegistry, got list"):
        ControlServer(st, [])
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\].*got 70000"):
        ControlServer(st, reg, port=70000)
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1, got 0"):
        ControlServer(st, reg, max_body_bytes=0)
    with pytest.raises(ValueError, match="request_timeout must be a number of seconds > 0, got -1"):
        ControlServer(st, reg, request_timeout=-1)
    with pytest.raises(ValueError, match="max_connections must be an int >= 1, got 0"):
        ControlServer(st, reg, max_connections=0)
    with pytest.raises(TypeError, match="metrics_fn must be callable, got dict"):
        ControlServer(st, reg, metrics_fn={})
    with pytest.raises(TypeError, match=r"reward_swapper must have a stage_reward_swap\(spec, client\) method, got str"):
        ControlServer(st, reg, reward_swapper="exact_match")
    with pytest.raises(TypeError, match="token must be a str, got int"):
        ControlServer(st, reg, token=1234)


def test_start_twice_and_port_in_use(server, parts):
    with pytest.raises(RuntimeError, match="already started at http://127.0.0.1:"):
        server.start()
    other = ControlServer(parts["state"], parts["registry"], port=server.port, token=TOKEN)
    with pytest.raises(OSError, match=rf"cannot bind 127.0.0.1:{server.port}"):
        other.start()


# ---- bodies ------------------------------------------------------------------------------------------------------
def test_body_over_limit_is_413_before_reading(server, parts):
    # Content-Length announces 10 MB that are never sent: the answer must come without reading them
    head = (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Length: 10000000\r\n\r\n").encode()
    a = raw_exchange(server.port, head)
    assert a.status == 413 and a.json["error"] == "request body of 10000000 bytes is over the limit of 1024 bytes"
    assert a.headers["connection"] == "close"
    just_over = call(server.url, "PATCH", "/v1/state", raw=b'{"lam": 0.9' + b" " * 1020 + b"}", token=TOKEN)
    assert just_over.status == 413 and just_over.headers["connection"] == "close"
    assert parts["state"].staged() == []


def test_expect_100_continue(server, parts):
    head = (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n").encode()
    a = raw_exchange(server.port, head)  # refused before the body is sent: no '100 Continue' first
    assert a.status == 413 and a.json["error"].startswith("request body of 5000 bytes is over the limit")
    payload = b'{"lam": 0.5}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall((f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n"
                   f"Expect: 100-continue\r\nContent-Length: {len(payload)}\r\n\r\n").encode())
        reader = RawReader(s)
        assert reader.head()[0] == 100  # the server invites the body only once it wants it
        s.sendall(payload)
        answer = reader.answer()
    assert answer.status == 202 and answer.json["staged"] == {"lam": 0.5}


def test_chunked_body_over_limit_is_413_and_small_chunked_body_works(server, parts):
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    big = (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n"
           + "".join("200\r\n" + " " * 0x200 + "\r\n" for _ in range(3)) + "0\r\n\r\n").encode()
    a = raw_exchange(server.port, big)
    assert a.status == 413 and "chunked request body is over the limit of 1024 bytes" in a.json["error"]
    payload = b'{"top_p": 0.9}'
    small = (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n"
             "Connection: close\r\n\r\n").encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    a = raw_exchange(server.port, small)
    assert a.status == 202 and a.json["staged"] == {"top_p": 0.9}


def test_body_without_length_is_411(server):
    head = f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    a = raw_exchange(server.port, head)
    assert a.status == 411 and a.json["error"].startswith("Content-Length header required")


@pytest.mark.parametrize("framing,message", [
    ("Content-Length: 50\r\n\r\n", "request body ended after 7 bytes of 50 bytes: the client closed its side"),
    ("Transfer-Encoding: chunked\r\n\r\n7\r\n", "request body ended after 7 bytes before the last chunk: the "
                                                  "client closed its side"),
])
def test_body_cut_short_by_the_client_is_400(server, parts, framing, message):
    head = f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n{framing}"
    a = raw_exchange(server.port, head.encode() + b'{"lam":')  # then half-close: the rest never comes
    assert a.status == 400 and a.json["error"] == message and parts["state"].staged() == []


@pytest.mark.parametrize("raw,message", [
    (b'{"kl_coef": 0.1', "request body is not valid JSON: Expecting ',' delimiter"),
    (b"", "request body is empty; send a JSON object"),
    (b"[1, 2]", "request body must be a JSON object, got a JSON array"),
    (b'"kl_coef"', "request body must be a JSON object, got a JSON string"),
    (b"null", "request body must be a JSON object, got a JSON null"),
    (b'{"kl_coef": NaN}', "request body is not valid JSON: NaN is not allowed"),
    (b'{"kl_coef": 0.1, "kl_coef": 0.2}', "request body is not valid JSON: duplicate key 'kl_coef'"),
    (b'{"kl_coef": "\xff"}', "request body is not UTF-8"),
    (b"{}", "empty update: send a JSON object of {key: value} with at least one key"),
])
def test_malformed_bodies_are_400(server, parts, raw, message):
    a = call(server.url, "PATCH", "/v1/state", raw=raw, token=TOKEN)
    assert a.status == 400 and a.json["error"].startswith(message), a
    assert parts["state"].staged() == []


@pytest.mark.parametrize("length,reason", [("-5", "bad Content-Length"), ("12abc", "bad Content-Length"),
                                           ("0x10", "bad Content-Length"), ("1, 2", "conflicting Content-Length headers")])
def test_invalid_content_length_is_400(server, parts, length, reason):
    # h11 parses the framing: its reason, as JSON, and the connection is closed
    head = f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n\r\n"
    a = raw_exchange(server.port, head.encode())
    assert a.status == 400 and a.json == {"error": f"malformed HTTP/1.1 request: {reason}", "status": 400}
    assert a.headers["connection"] == "close" and parts["state"].staged() == []


def test_rejected_update_names_every_bad_key_and_stages_nothing(server, parts):
    bad = {"kl_coeff": 0.1, "global_step": 5, "top_k": "3", "temperature": 0.0, "top_p": 1.5, "kl_coef": 0.2}
    a = call(server.url, "PATCH", "/v1/state", bad, token=TOKEN)
    assert a.status == 400
    errors = a.json["errors"]
    assert sorted(errors) == ["global_step", "kl_coeff", "temperature", "top_k", "top_p"]
    assert "did you mean 'kl_coef'" in errors["kl_coeff"]
    assert errors["global_step"].startswith("read-only at run time")
    assert errors["top_k"] == "expected int, got str '3'"
    assert errors["temperature"] == f"0.0 is out of range {range_text('temperature')}"
    assert errors["top_p"] == f"1.5 is out of range {range_text('top_p')}"
    assert a.json["error"].startswith("SharedState refused 5 key(s)")
    assert parts["state"].staged() == [] and parts["state"].apply_staged() == []
    assert parts["state"].get("kl_coef") == default("kl_coef")


def test_unauthorised_request_with_a_body_closes_the_connection(server):
    a = call(server.url, "PATCH", "/v1/state", {"lam": 0.9}, token="wrong")
    assert a.status == 401 and a.headers["connection"] == "close"  # the unread body is not parsed as a request


# ---- routes and methods ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/", "/v1", "/v2/models", "/v1/modelsx", "/v1/state/x/y/../z/..", "/favicon.ico"])
def test_unknown_route_is_json_404(server, path):
    a = call(server.url, "GET", path)
    assert a.status == 404 and a.headers["content-type"] == "application/json"
    assert a.json["error"].startswith(("no route for this path; routes: GET /healthz", "unknown SharedState key ("))
    assert path not in a.json["error"].split("; routes:")[0]  # the path sent is not repeated back


@pytest.mark.parametrize("method,path,allow,error", [
    ("DELETE", "/v1/state", "GET, HEAD, PATCH", "method DELETE not allowed on /v1/state"),
    ("POST", "/v1/state", "GET, HEAD, PATCH", "method POST not allowed on /v1/state"),
    ("PUT", "/v1/models", "GET, HEAD", "method PUT not allowed on /v1/models"),
    ("POST", "/v1/models", "GET, HEAD", "method POST not allowed on /v1/models"),
    ("POST", "/v1/models/actor", "GET, HEAD", "method POST not allowed on /v1/models/{id}"),
    ("DELETE", "/v1/models/reward", "GET, HEAD, POST", "method DELETE not allowed on /v1/models/reward"),
    ("PATCH", "/v1/state/kl_coef", "GET, HEAD", "method PATCH not allowed on /v1/state/{key}"),
    ("POST", "/healthz", "GET, HEAD", "method POST not allowed on /healthz"),
    ("POST", "/metrics", "GET, HEAD", "method POST not allowed on /metrics"),
    ("BREW", "/v1/state", "GET, HEAD, PATCH", "this method not allowed on /v1/state"),  # not a standard method
])
def test_wrong_method_is_405_with_allow(server, method, path, allow, error):
    """The answer names the route and the allowed methods, never the path or a non-standard method sent."""
    a = call(server.url, method, path, token=TOKEN)
    assert a.status == 405 and a.headers["allow"] == allow
    assert a.json["error"] == f"{error}; allowed: {allow}"


@pytest.mark.parametrize("raw,reason", [
    (b"GARBAGE\r\n\r\n", "illegal request line"),
    (b"GET /healthz\r\n\r\n", "illegal request line"),  # HTTP/0.9: no version
    (b"GET /healthz HTTP/1.1\r\n\r\n", "Missing mandatory Host: header"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", "illegal header line"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", "illegal header line"),
])
def test_malformed_request_is_json_400(server, raw, reason):
    a = raw_exchange(server.port, raw)
    assert a.status == 400 and a.json == {"error": f"malformed HTTP/1.1 request: {reason}", "status": 400}


def test_reward_swap_without_swapper_is_501(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN) as srv:
        a = call(srv.url, "POST", "/v1/models/reward", {"function": "parity"}, token=TOKEN)
        assert a.status == 501 and "no reward_swapper" in a.json["error"]


def test_handler_exception_is_500_logged_and_server_keeps_serving(parts, caplog):
    calls = {"n": 0}

    def broken_metrics():
        calls["n"] += 1
        raise RuntimeError("metrics backend exploded")

    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, metrics_fn=broken_metrics) as srv:
        with caplog.at_level(logging.ERROR, logger="verl_ds.server"):
            a = call(srv.url, "GET", "/metrics")
        assert a.status == 500
        assert a.json["error"] == "internal server error: RuntimeError: metrics backend exploded"
        assert any("GET /metrics failed" in r.getMessage() and r.exc_info for r in caplog.records)
        for _ in range(3):
            assert call(srv.url, "GET", "/healthz").status == 200
        assert call(srv.url, "GET", "/metrics").status == 500 and calls["n"] == 2


# ---- slow and greedy clients -------------------------------------------------------------------------------------
def test_slow_client_does_not_block_others_and_is_dropped(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=0.5) as srv:
        stalled_head = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        stalled_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # half a request, then nothing
        stalled_body = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        stalled_body.sendall(f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                             "Content-Length: 40\r\n\r\n{\"lam\":".encode())
        try:
            for _ in range(20):
                assert call(srv.url, "GET", "/healthz").status == 200
            assert call(srv.url, "PATCH", "/v1/state", {"gamma": 0.99}, token=TOKEN).status == 202
            # past the deadlines the server gives up on both: a close for the first, 408 for the second
            assert dropped(stalled_head)
            answer = RawReader(stalled_body).answer()
            assert answer.status == 408 and answer.json["error"] == "timed out after 0.5 s waiting for the request body"
            assert answer.headers["connection"] == "close"
        finally:
            stalled_head.close()
            stalled_body.close()
        assert [s["key"] for s in parts["state"].staged()] == ["gamma"]


def test_requests_in_progress_cap_answers_503_and_frees_the_slot(parts):
    entered, release = threading.Event(), threading.Event()

    def slow_metrics():  # holds the only request slot until released
        entered.set()
        assert release.wait(30)
        return {"step": 1}

    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, max_connections=1,
                       metrics_fn=slow_metrics) as srv:
        held = {}
        hog = threading.Thread(target=lambda: held.setdefault("answer", call(srv.url, "GET", "/metrics", timeout=60)))
        hog.start()
        try:
            assert entered.wait(30)
            a = call(srv.url, "GET", "/healthz")
            assert a.status == 503 and a.headers["retry-after"] == "1" and a.headers["connection"] == "close"
            assert a.json == {"error": "too many requests in progress (at most 1); retry later", "status": 503}
        finally:
            release.set()
            hog.join(60)
        assert held["answer"].status == 200 and "verl_ds_step 1" in held["answer"].text
        # the slot is released before the answer is sent, so it is free now
        assert call(srv.url, "GET", "/healthz").status == 200


def test_stop_does_not_wait_for_a_stalled_client(parts):
    srv = ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=30.0)
    srv.start()
    stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    stalled.sendall(b"GET /healthz HTTP/1.1\r\n")
    done = threading.Event()
    threading.Thread(target=lambda: (srv.stop(), done.set()), daemon=True).start()
    try:
        assert done.wait(20), "stop() hung on a stalled client"
    finally:
        stalled.close()
    with pytest.raises(OSError):
        call(srv.url, "GET", "/healthz")


def test_stop_does_not_wait_for_a_stuck_view_and_logs_no_error(parts, caplog):
    entered, release = threading.Event(), threading.Event()

    def stuck_metrics():
        entered.set()
        release.wait(60)
        return {}

    srv = ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, metrics_fn=stuck_metrics)
    srv.start()
    outcome = {}

    def fetch():
        try:
            outcome["answer"] = call(srv.url, "GET", "/metrics", timeout=60)
        except OSError as e:  # http.client's RemoteDisconnected is a ConnectionResetError
            outcome["error"] = e

    client = threading.Thread(target=fetch, daemon=True)
    client.start()
    try:
        assert entered.wait(30)
        with caplog.at_level(logging.WARNING):
            done = threading.Event()
            threading.Thread(target=lambda: (srv.stop(), done.set()), daemon=True).start()
            assert done.wait(20), "stop() waited for a view stuck in a worker thread"
        client.join(30)
        assert "error" in outcome, outcome  # the client saw its connection dropped, without an answer
    finally:
        release.set()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_other_registry_and_state_still_work_after_errors(parts):
    """A fresh state/registry pair: a burst of bad requests leaves nothing staged and the server healthy."""
    state, reg = SharedState(rank=0), make_registry()
    with ControlServer(state, reg, port=0, token=TOKEN, max_body_bytes=64) as srv:
        for raw in (b"{", b"[]", b"x" * 100, b'{"actor_lr": -1}'):
            assert call(srv.url, "PATCH", "/v1/state", raw=raw, token=TOKEN).status in (400, 413)
        assert state.staged() == []
        assert call(srv.url, "GET", "/healthz").status == 200
