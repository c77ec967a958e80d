"""HTTP/1.1 details that a hostile client used to turn against the server, with real sockets on 127.0.0.1: an
idle-socket flood at the connection cap, a chunk size far over the body limit, a request framed both by
Content-Length and by Transfer-Encoding (request smuggling), other HTTP versions. /healthz keeps answering."""
import socket
import threading
import time

import pytest
from server_testutil import TOKEN, IdleFlood, RawReader, call, connect, dropped, raw_exchange

from verl_ds.server import ControlServer

_AUTH = f"Authorization: Bearer {TOKEN}\r\n"


def test_idle_socket_flood_does_not_lock_out_new_clients(parts):
    """300 idle sockets (cap 256), reopened as soon as the server closes one: each new client is still answered
    at once (the longest idle connection makes room), and the oldest flood sockets were closed without a byte."""
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=10.0) as srv:
        assert srv.max_open_connections == 256
        with IdleFlood(srv.port, 300) as flood:
            times = []
            for _ in range(20):
                t = time.monotonic()
                a = call(srv.url, "GET", "/healthz", timeout=30)
                times.append(time.monotonic() - t)
                assert a.status == 200 and a.json["status"] == "ok", a
                # a keep-alive client with two requests on one connection is answered both times
                with connect(srv.port) as s:
                    reader = RawReader(s)
                    for _ in range(2):
                        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                        assert reader.answer().status == 200
            assert max(times) < 5.0, times  # never the 10 s of waiting for an idle socket's deadline
            assert flood.reopened >= 44  # the 44 over the cap, then one per new client
            assert all(dropped(s) for s in flood.first[:40])  # the oldest ones, closed without an answer


def test_open_connection_cap_answers_503_when_every_connection_is_busy_and_frees_the_slot(parts):
    """Idle connections make room for new ones (the test above); connections whose request is in
    progress (here: waiting for an announced body) are not closed, so past the cap a new one gets 503."""
    head = (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 12\r\n"
            "Expect: 100-continue\r\n\r\n")
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, max_open_connections=2,
                       request_timeout=30.0) as srv:
        hogs = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(2)]
        try:
            readers = [RawReader(h) for h in hogs]
            for h, r in zip(hogs, readers):  # a request each, its body not yet sent: both connections are busy
                h.sendall(head.encode())
                assert r.head()[0] == 100  # the server reads the body: the request is in progress
            a = call(srv.url, "GET", "/healthz")
            assert a.status == 503 and a.json == {"error": "too many open connections; retry later", "status": 503}
            # one hog's request is answered: its connection is idle now and makes room for a new one
            hogs[0].sendall(b'{"lam": 0.9}')
            assert readers[0].answer().status == 202
            assert call(srv.url, "GET", "/healthz").status == 200
        finally:
            for h in hogs:
                h.close()


@pytest.mark.parametrize("size_line", [b"FFFFFFFFFFFFFFFF", b"ffffffffffffffffffff", b"10001"])
def test_chunk_size_over_the_limit_is_413_at_once(parts, size_line):
    """The size line alone is enough: 413 at once, not a 408 when the body deadline passes."""
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=10.0) as srv:
        with connect(srv.port) as s:
            t = time.monotonic()
            s.sendall(b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode() +
                      b"Transfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\n")
            a = RawReader(s).answer()
            elapsed = time.monotonic() - t
        assert a.status == 413 and a.headers["connection"] == "close", a
        assert a.json["error"] == "chunked request body is over the limit of 65536 bytes"
        assert elapsed < 5.0, elapsed
        assert call(srv.url, "GET", "/healthz").status == 200
    assert parts["state"].staged() == []


def test_chunks_that_add_up_over_the_limit_are_413_when_the_last_size_line_arrives(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, max_body_bytes=1024,
                       request_timeout=10.0) as srv:
        with connect(srv.port) as s:
            t = time.monotonic()
            s.sendall(b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode() + b"Transfer-Encoding: chunked\r\n\r\n"
                      + b"200\r\n" + b" " * 0x200 + b"\r\n" + b"201\r\n")  # 512 sent + 513 announced > 1024
            a = RawReader(s).answer()
        assert a.status == 413 and time.monotonic() - t < 5.0, a
        with connect(srv.port) as s:  # exactly the limit is fine
            s.sendall(b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode() + b"Transfer-Encoding: chunked\r\n\r\n"
                      + b"200\r\n" + b" " * 0x200 + b"\r\n" + b"200\r\n" + b'{"lam": 0.9}'.ljust(0x200) + b"\r\n0\r\n\r\n")
            assert RawReader(s).answer().status == 202
    assert [p["key"] for p in parts["state"].staged()] == ["lam"]


@pytest.mark.parametrize("headers", [b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                                     b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                                     b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"])
def test_content_length_with_transfer_encoding_is_400_and_smuggles_nothing(server, parts, headers):
    """The body says '0' (end of a chunked body) where Content-Length counts 5 bytes; a proxy reading one
    framing and this server the other would each see a different second request. Refused, connection closed,
    the request hidden behind it never served, even with the token."""
    smuggled = (b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode() + b"Content-Length: 12\r\n\r\n"
                b'{"lam": 0.5}')
    raw = b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode() + headers + b"\r\n0\r\n\r\n" + smuggled
    with connect(server.port) as s:
        s.sendall(raw)
        reader = RawReader(s)
        a = reader.answer()
        rest = reader.rest()
    assert a.status == 400 and a.headers["connection"] == "close"
    assert a.json == {"error": "malformed HTTP/1.1 request: both Content-Length and Transfer-Encoding are set; send "
                               "one of them", "status": 400}
    assert rest == b""  # no second answer: the smuggled request was never read as one
    assert parts["state"].staged() == []
    assert call(server.url, "GET", "/healthz").status == 200


@pytest.mark.parametrize("raw", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # the HTTP/2 connection preface
                                 b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
                                 b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n",
                                 b"GET /healthz HTTP/0.9\r\nHost: x\r\n\r\n",
                                 b"PATCH /v1/state HTTP/3.0\r\nHost: x\r\n" + _AUTH.encode() + b"Content-Length: 12\r\n\r\n"
                                 b'{"lam": 0.5}'])
def test_other_http_versions_are_505(server, parts, raw):
    a = raw_exchange(server.port, raw)
    assert a.status == 505 and a.headers["connection"] == "close"
    assert a.json == {"error": "HTTP version not supported: this server speaks HTTP/1.1 (and 1.0)", "status": 505}
    assert parts["state"].staged() == []


def test_http_1_0_is_still_served(server):
    a = raw_exchange(server.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert a.status == 200 and a.json["status"] == "ok"


def test_health_checks_go_on_under_all_of_these_at_once(parts):
    """The flood, huge chunk sizes, smuggling attempts and other versions from several threads while /healthz
    is polled: every health check is answered 200, and quickly."""
    hostile = [b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode() + b"Transfer-Encoding: chunked\r\n\r\n"
               b"FFFFFFFFFFFFFFFF\r\n",
               b"PATCH /v1/state HTTP/1.1\r\nHost: x\r\n" + _AUTH.encode()
               + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
               b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n"]
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=10.0) as srv:
        with IdleFlood(srv.port, 280):
            statuses, stop = [], threading.Event()

            def attack():
                for _ in range(25):
                    for raw in hostile:
                        if stop.is_set():
                            return
                        statuses.append(raw_exchange(srv.port, raw).status)

            attackers = [threading.Thread(target=attack) for _ in range(3)]
            for t in attackers:
                t.start()
            health = []
            for _ in range(30):
                t0 = time.monotonic()
                health.append((call(srv.url, "GET", "/healthz", timeout=30).status, time.monotonic() - t0))
            stop.set()
            for t in attackers:
                t.join(120)
    assert {s for s, _ in health} == {200} and max(d for _, d in health) < 5.0, health
    assert set(statuses) <= {413, 400, 505} and len(statuses) >= 30
