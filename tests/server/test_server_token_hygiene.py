"""The bearer token never appears in an answer (body or header) or in a log line, whatever the client sends:
wrong and right tokens, the token echoed back through a path, a body value, a reward name, a broken
header, or an exception message of a view."""
import logging
import socket

from server_testutil import RawReader, call

from verl_ds.server import ControlServer

SECRET = "tok-7f3a9c1e5b2d"


def _answers(srv) -> list:
    """Every request a client could use to make the server repeat the token back."""
    url, port = srv.url, srv.port
    out = [
        call(url, "PATCH", "/v1/state", {"lam": 0.9}, token=SECRET),  # right token
        call(url, "PATCH", "/v1/state", {"lam": 0.9}, token=SECRET[:-1]),  # a prefix
        call(url, "PATCH", "/v1/state", {"lam": 0.9}, token=SECRET + "x"),
        call(url, "PATCH", "/v1/state", {"lam": 0.9}, headers={"Authorization": f"Basic {SECRET}"}),
        call(url, "PATCH", "/v1/state", {"lam": 0.9}, headers={"Authorization": SECRET}),
        call(url, "PATCH", "/v1/state", {"kl_kind": SECRET, SECRET: 1}, token=SECRET),  # echoed by SharedState
        call(url, "PATCH", "/v1/state", raw=b'{"lam": "' + SECRET.encode() + b'"', token=SECRET),  # broken JSON
        call(url, "POST", "/v1/models/reward", {"function": SECRET}, token=SECRET),  # unknown reward name
        call(url, "POST", "/v1/models/reward", {"function": f"/{SECRET}.py:f"}, token=SECRET),
        call(url, "GET", f"/v1/state/{SECRET}"),  # unknown key, echoed with suggestions
        call(url, "GET", f"/v1/models/{SECRET}"),
        call(url, "GET", f"/{SECRET}"),  # unknown route
        call(url, "GET", f"/v1/models?token={SECRET}"),
        call(url, "GET", "/metrics"),  # the view raises with the token in its message
        call(url, "HEAD", f"/v1/state/{SECRET}"),
    ]
    for raw in (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\x01\r\n\r\n",
                f"GET /{SECRET} HTTP/1.1\r\nHost: x\r\nX: {SECRET}\x00\r\n\r\n",
                f"GET /healthz HTTP/1.1\r\nHost: x\r\n{SECRET}\r\n\r\n",
                f"{SECRET}\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(raw.encode("latin-1"))
            out.append(RawReader(s).answer())
    return out


def test_token_never_in_answers_or_logs(parts, caplog):
    def leaky_metrics():
        raise RuntimeError(f"backend refused credentials {SECRET!r}")

    with caplog.at_level(logging.DEBUG):
        with ControlServer(parts["state"], parts["registry"], port=0, token=SECRET, metrics_fn=leaky_metrics,
                           reward_swapper=parts["swapper"], run_dir=parts["run_dir"]) as srv:
            answers = _answers(srv)
    statuses = [a.status for a in answers]
    assert statuses[0] == 202 and statuses[1:5] == [401] * 4 and 500 in statuses and 400 in statuses, statuses
    for a in answers:
        assert SECRET not in a.raw.decode("utf-8", "replace"), a
        assert not any(SECRET in f"{k}: {v}" for k, v in a.headers.items()), a.headers
    # where an authenticated request's own data is repeated back (an unknown key or reward name, the 500 of
    # a view) the token reads '<redacted>'; answers before authentication repeat nothing (no marker either)
    assert [i for i, a in enumerate(answers) if "<redacted>" in a.text] == [5, 7, 8, 13]
    logged = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records and SECRET not in logged
    assert any(r.exc_info for r in caplog.records)  # the 500 was logged with its traceback, redacted
    assert (parts["run_dir"] / "server_url.txt").exists() is False


def _unauthenticated(srv, guesses: str) -> list:
    """Requests that never authenticate, each carrying ``guesses`` where an answer could repeat it."""
    port = srv.port
    raws = [f"GET /v1/state/{guesses} HTTP/1.1", f"GET /v1/models/{guesses} HTTP/1.1", f"GET /{guesses} HTTP/1.1",
            f"GET /v1/{guesses}/state HTTP/1.1", f"HEAD /v1/state/{guesses} HTTP/1.1",
            f"PATCH /v1/state/{guesses} HTTP/1.1", f"POST /v1/models/{guesses} HTTP/1.1",
            f"{guesses} /v1/state HTTP/1.1",  # a method is any token
            f"GET /v1/models?{guesses} HTTP/1.1"]
    out = []
    for line in raws:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(f"{line}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            out.append(RawReader(s).answer(to_head=line.startswith("HEAD")))
    out.append(call(srv.url, "PATCH", "/v1/state", {"lam": 0.9}, headers={"Authorization": f"Bearer {guesses}"}))
    return out


def test_answers_before_authentication_repeat_nothing_the_client_sent(parts):
    """1,500 guesses in one path (the token among them) once drew a 404 naming every guess but the token,
    which read '<redacted>': its position gave the token away without a single 401. Answers before
    authentication now repeat nothing the client sent: they are the same bytes with and without the token."""
    guesses = [f"G{i:04d}-" for i in range(1500)]
    with ControlServer(parts["state"], parts["registry"], port=0, token=SECRET,
                       reward_swapper=parts["swapper"]) as srv:
        with_token = _unauthenticated(srv, "".join(guesses[:777] + [SECRET] + guesses[778:]))
        without = _unauthenticated(srv, "".join(guesses))
        assert call(srv.url, "GET", "/healthz").status == 200
    assert [a.status for a in with_token] == [404, 404, 404, 404, 404, 405, 405, 405, 200, 401]
    for a, b in zip(with_token, without):
        assert (a.status, a.headers, a.raw) == (b.status, b.headers, b.raw)
        assert "G07" not in a.text and SECRET not in a.text and "<redacted>" not in a.text, a
    assert parts["state"].staged() == []
