"""A corpus of hostile, invalid and valid requests for the control server, with the status each must get.

Importable for a soak against a live training job::

    sys.path.insert(0, "tests/server")
    from hostile_requests import CORPUS, send
    for case in CORPUS * 3:
        if not case.mutates:                       # skip the few valid changes on a real run
            assert send(case, port, token).status == case.status, case.name

The expected statuses assume the server's defaults (``max_body_bytes=65536``, ``request_timeout`` of a few
seconds), a token, a reward swapper (the trainer), ``allow_reward_code=false`` and no
``swappable_rewards``; ``{token}`` in a header, body or raw request is replaced by the token at send time.
"""
from __future__ import annotations

import socket
from typing import NamedTuple

from server_testutil import Answer, RawReader


class Case(NamedTuple):
    name: str
    method: str  # "RAW": ``body`` is the whole request as bytes
    path: str
    headers: tuple  # ((name, value), ...): repeated names are sent repeatedly
    body: bytes | None
    status: int
    mutates: bool = False  # a valid change (202): skipped by a soak against a real run


AUTH = (("Authorization", "Bearer {token}"),)
JSON = (("Content-Type", "application/json"),)


def _get(name: str, path: str, status: int = 200, method: str = "GET") -> Case:
    return Case(name, method, path, (), None, status)


def _patch(name: str, body: bytes, status: int = 400, headers: tuple = AUTH + JSON, mutates: bool = False) -> Case:
    return Case(name, "PATCH", "/v1/state", headers, body, status, mutates)


def _reward(name: str, body: bytes, status: int = 400, mutates: bool = False) -> Case:
    return Case(name, "POST", "/v1/models/reward", AUTH + JSON, body, status, mutates)


def _raw(name: str, request: bytes, status: int) -> Case:
    return Case(name, "RAW", "", (), request, status)


_HEAD = b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
_GUESSES = b"".join(b"G%04d-" % i for i in range(777)) + b"{token}-" + b"".join(b"G%04d-" % i for i in range(778, 1500))

CORPUS: list[Case] = [
    # ---- valid reads -------------------------------------------------------------------------------------------
    _get("healthz", "/healthz"), _get("metrics", "/metrics"), _get("models", "/v1/models"),
    _get("model by name", "/v1/models/actor"), _get("model by alias", "/v1/models/policy"),
    _get("state", "/v1/state"), _get("state key", "/v1/state/kl_coef"), _get("head", "/healthz", method="HEAD"),
    _get("query string ignored", "/v1/models?limit=1"), _get("trailing slash", "/v1/state/"),
    # ---- unknown routes and wrong methods ------------------------------------------------------------------------
    _get("root", "/", 404), _get("v2", "/v2/models", 404), _get("dot-dot key", "/v1/state/x/../..", 404),
    _get("unknown model", "/v1/models/actr", 404), _get("unknown key", "/v1/state/kl_coeff", 404),
    _get("absolute-form target", "http://evil.example/v1/state", 404),
    _get("percent-encoded NUL", "/v1/state/%00", 404), _get("long path", "/" + "a" * 8000, 404),
    _get("DELETE state", "/v1/state", 405, "DELETE"), _get("PUT models", "/v1/models", 405, "PUT"),
    _get("BREW", "/v1/state", 405, "BREW"), _get("POST healthz", "/healthz", 405, "POST"),
    _get("POST to another model", "/v1/models/actor", 405, "POST"),
    # ---- authentication ------------------------------------------------------------------------------------------
    _patch("no token", b'{"lam": 0.9}', 401, JSON), _patch("wrong token", b'{"lam": 0.9}', 401,
                                                         (("Authorization", "Bearer {token}x"),)),
    _patch("basic scheme", b'{"lam": 0.9}', 401, (("Authorization", "Basic {token}"),)),
    _patch("bare token", b'{"lam": 0.9}', 401, (("Authorization", "{token}"),)),
    _patch("two authorization headers", b'{"lam": 0.9}', 401, AUTH + AUTH),
    Case("reward without token", "POST", "/v1/models/reward", JSON, b'{"function": "parity"}', 401),
    # ---- bodies --------------------------------------------------------------------------------------------------
    _patch("empty body", b""), _patch("not JSON", b'{"kl_coef": 0.1'), _patch("array", b"[1, 2]"),
    _patch("string", b'"kl_coef"'), _patch("NaN", b'{"kl_coef": NaN}'), _patch("Infinity", b'{"kl_coef": Infinity}'),
    _patch("1e309", b'{"kl_coef": 1e309}'), _patch("huge int", b'{"top_k": 1' + b"0" * 5000 + b"}"),
    _patch("duplicate key", b'{"lam": 0.9, "lam": 0.8}'), _patch("not UTF-8", b'{"kl_kind": "\xff"}'),
    _patch("60000 nested arrays", b"[" * 60000), _patch("nested objects", b'{"a":' * 5000 + b"1" + b"}" * 5000),
    _patch("empty object", b"{}"), _patch("patch of an unknown key", b'{"kl_coeff": 0.1}'),
    _patch("read-only key", b'{"global_step": 5}'), _patch("wrong type", b'{"top_k": "3"}'),
    _patch("out of range", b'{"top_p": 1.5}'), _patch("bool for float", b'{"lam": true}'),
    _patch("null value", b'{"lam": null}'), _patch("over the body limit", b'{"lam": 0.9' + b" " * 70000 + b"}", 413),
    # ---- reward swaps ----------------------------------------------------------------------------------------------
    _reward("weight 1e309", b'{"functions":[{"name":"parity","weight":1e309}]}'),
    _reward("model weight 1e309", b'{"function":"parity","model_path":"/tmp","model_weight":1e309}'),
    _reward("per_token not a bool", b'{"functions":[{"name":"parity","per_token":"no"}]}'),
    _reward("model path root", b'{"model_path":"/"}'), _reward("model path relative", b'{"model_path":"../.."}'),
    _reward("builtins:print", b'{"function":"builtins:print"}'), _reward("os:system", b'{"function":"os:system"}'),
    _reward("file code", b'{"function":"/etc/passwd.py:x"}'), _reward("unknown name", b'{"function":"exact_mach"}'),
    _reward("unknown field", b'{"function":"parity","model":"x"}'), _reward("functions not a list", b'{"functions":"parity"}'),
    _reward("seventeen functions", b'{"functions":[' + b",".join([b'"parity"'] * 17) + b"]}"),
    _reward("duplicate functions", b'{"functions":["parity","parity"]}'), _reward("nothing to swap", b'{"functions":[]}'),
    _reward("model weight alone", b'{"function":"parity","model_weight":2}'),
    # ---- protocol: framing, heads, limits (sent as raw bytes) -----------------------------------------------------
    _raw("garbage request line", b"GARBAGE\r\n\r\n", 400), _raw("HTTP/0.9", b"GET /healthz\r\n\r\n", 400),
    _raw("no Host", b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    _raw("header without colon", b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    _raw("NUL in a header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
    _raw("head over 16 KiB", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
    _raw("negative Content-Length", _HEAD + b"Content-Length: -5\r\n\r\n", 400),
    _raw("two Content-Lengths", _HEAD + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
    _raw("Content-Length over the limit, body never sent", _HEAD + b"Content-Length: 10000000\r\n\r\n", 413),
    _raw("Expect 100-continue over the limit", _HEAD + b"Expect: 100-continue\r\nContent-Length: 70000\r\n\r\n", 413),
    _raw("no length", _HEAD + b"\r\n", 411),
    _raw("chunk size -1", _HEAD + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n" + b"x" * 1000 + b"\r\n0\r\n\r\n", 400),
    _raw("chunk size not hex", _HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nx\r\n0\r\n\r\n", 400),
    _raw("chunked over the limit", _HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
         + b"".join(b"4000\r\n" + b" " * 0x4000 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n", 413),
    _raw("huge chunk size", _HEAD + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n" + b"x" * 70000, 413),
    _raw("gzip transfer-encoding", _HEAD + b"Transfer-Encoding: gzip\r\n\r\n", 501),
    _raw("body cut short", _HEAD + b"Content-Length: 50\r\n\r\n{\"lam\":", 400),
    _raw("huge chunk size, no body", _HEAD + b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\n", 413),
    _raw("chunk sizes adding up over the limit", _HEAD + b"Transfer-Encoding: chunked\r\n\r\n4000\r\n"
         + b" " * 0x4000 + b"\r\nf000\r\n", 413),
    _raw("Content-Length and chunked", _HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    _raw("chunked and Content-Length", _HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 14\r\n\r\n"
         + b"e\r\n{\"lam\": 0.9}  \r\n0\r\n\r\n", 400),
    _raw("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    _raw("HTTP/9.9", b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 505),
    _raw("HTTP/2.0 request line", b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    _raw("HTTP/1.0", b"GET /healthz HTTP/1.0\r\n\r\n", 200),
    # ---- the token among guesses, before authentication: answered without repeating any of it -------------------
    _raw("token among 1500 guesses in a state key", b"GET /v1/state/" + _GUESSES + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    _raw("token among guesses in a model id", b"GET /v1/models/" + _GUESSES + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    _raw("token among guesses in a route", b"GET /" + _GUESSES + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    _raw("token among guesses as a method", _GUESSES + b" /v1/state HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    # ---- bodies that a quadratic scan made cost ~28 s of CPU each -----------------------------------------------
    _patch("64 KB of escaped quotes", b'"' + b'\\"' * 32000),
    _patch("64 KB of a-escapes", b'"a\\' * 21800),
    # ---- valid changes (202) ----------------------------------------------------------------------------------------
    _patch("valid patch", b'{"lam": 0.95}', 202, mutates=True),
    _patch("valid chunked patch", b'{"gamma": 1}', 202,
           AUTH + JSON + (("Transfer-Encoding", "chunked"),), mutates=True),
    _reward("valid reward swap", b'{"function": "parity"}', 202, mutates=True),
]


def render(case: Case, token: str) -> bytes:
    """The bytes of ``case`` on the wire (one request, ``Connection: close``)."""
    if case.method == "RAW":
        return case.body.replace(b"{token}", token.encode())
    headers = [("Host", "127.0.0.1")] + [(k, v.replace("{token}", token)) for k, v in case.headers]
    names = {k.lower() for k, _ in headers}
    body = case.body
    if body is not None and "transfer-encoding" in names:
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    elif body is not None:
        headers.append(("Content-Length", str(len(body))))
    headers.append(("Connection", "close"))
    head = f"{case.method} {case.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1") + (body or b"")


def send(case: Case, port: int, token: str, host: str = "127.0.0.1", timeout: float = 30.0) -> Answer:
    """Send one case on a fresh connection (then half-close) and read its answer to the end."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(render(case, token))
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before taking the whole request
            pass
        return RawReader(s).answer(to_head=case.method == "HEAD")
