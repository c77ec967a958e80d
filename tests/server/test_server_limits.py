"""Limits that hold whatever the client does: body size for every framing (with the server's memory
checked), whole-request deadlines against trickling clients, bursts, deep JSON, oversized heads."""
import logging
import socket
import threading
import time

import psutil
import pytest
from server_testutil import TOKEN, RawReader, call, dropped, raw_exchange

from verl_ds.server import ControlServer
from verl_ds.server.protocol import MAX_HEADER_BYTES

MiB = 1 << 20


def _patch_head(extra: str = "") -> bytes:
    return (f"PATCH /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n{extra}\r\n").encode()


class _PeakRSS:
    """The largest RSS of this process seen while the block runs (sampled by a thread)."""

    def __enter__(self):
        self.proc, self.stop, self.peak = psutil.Process(), threading.Event(), 0
        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.stop.wait(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.growth = max(self.peak, self.proc.memory_info().rss) - self.base


def _stream(sock: socket.socket, first: bytes, block: bytes, total: int, stop: threading.Event, sent: list) -> None:
    """Send ``first``, then ``block`` repeatedly up to ``total`` bytes, until the server closes or ``stop``."""
    try:
        sock.sendall(first)
        while sent[0] < total and not stop.is_set():
            sock.sendall(block)
            sent[0] += len(block)
    except OSError:
        pass  # the server closed the connection: what this test expects


@pytest.mark.parametrize("framing", ["one huge chunk", "many chunks", "content-length"])
def test_streamed_body_over_the_limit_is_413_and_never_buffered(parts, framing):
    """160 MB offered; the server answers 413 after 1 MiB and its memory does not grow with the stream."""
    total, block = 160 * MiB, b"x" * (64 * 1024)
    if framing == "one huge chunk":
        first, payload = _patch_head("Transfer-Encoding: chunked\r\n") + b"7fffffffffffffff\r\n", block
    elif framing == "many chunks":
        first, payload = _patch_head("Transfer-Encoding: chunked\r\n"), b"%x\r\n%s\r\n" % (len(block), block)
    else:  # a Content-Length under the limit, then more bytes than announced: they are the next "request"
        first, payload = _patch_head(f"Content-Length: {MiB // 2}\r\n"), block
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, max_body_bytes=MiB,
                       request_timeout=30.0) as srv, _PeakRSS() as rss:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
        stop, sent = threading.Event(), [0]
        sender = threading.Thread(target=_stream, args=(sock, first, payload, total, stop, sent), daemon=True)
        sender.start()
        try:
            answer = RawReader(sock).answer()
        finally:
            stop.set()
            sender.join(60)
            sock.close()
    if framing == "content-length":
        # the announced 512 KiB are read as a body (not JSON: 400); the bytes after it are not a request
        assert answer.status == 400 and answer.json["error"].startswith("request body is not valid JSON")
    else:
        assert answer.status == 413, answer
        assert answer.json["error"] == f"chunked request body is over the limit of {MiB} bytes"
        assert answer.headers["connection"] == "close"
    assert sent[0] < total, "the server never stopped the upload"
    assert rss.growth < 48 * MiB, f"server memory grew by {rss.growth / MiB:.0f} MiB while {sent[0] / MiB:.0f} MiB streamed"
    assert parts["state"].staged() == []


@pytest.mark.parametrize("size_line", [b"-1", b"-0", b"+10", b"0x10", b"zz", b"1" * 40])
def test_bad_chunk_size_is_400(server, parts, size_line):
    raw = _patch_head("Transfer-Encoding: chunked\r\n") + size_line + b"\r\n" + b"x" * 4096 + b"\r\n0\r\n\r\n"
    a = raw_exchange(server.port, raw)
    assert a.status == 400 and a.json == {"error": "malformed HTTP/1.1 request: illegal chunk header", "status": 400}
    assert parts["state"].staged() == []


def test_seventy_trickling_clients_do_not_lock_out_a_normal_one_and_are_dropped(parts):
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=1.5) as srv:
        slow = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(70)]
        stop, dead = threading.Event(), set()

        def trickle():  # one more header byte per socket per round; the head never completes in time
            for i in range(1, len(head) - 2):
                for n, s in enumerate(slow):
                    if n not in dead:
                        try:
                            s.sendall(head[i:i + 1])
                        except OSError:
                            dead.add(n)
                if stop.wait(0.2):
                    return

        for s in slow:
            s.sendall(head[:1])
        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        try:
            ok = call(srv.url, "GET", "/healthz")
            assert ok.status == 200 and ok.json["status"] == "ok"
            assert all(dropped(s) for s in slow)  # each socket was closed without an answer
        finally:
            stop.set()
            trickler.join(30)
            for s in slow:
                s.close()


def test_burst_of_200_concurrent_gets_is_answered(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN) as srv:
        barrier, answers, errors = threading.Barrier(200), [], []

        def get():
            barrier.wait(60)
            try:
                answers.append(call(srv.url, "GET", "/healthz", timeout=10))
            except Exception as e:  # noqa: BLE001 - a request left unanswered within 10 s
                errors.append(repr(e))

        threads = [threading.Thread(target=get) for _ in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert errors == [] and len(answers) == 200
    assert {a.status for a in answers} <= {200, 503} and any(a.status == 200 for a in answers)
    for a in answers:
        if a.status == 503:
            assert a.json["error"] in ("too many requests in progress (at most 64); retry later",
                                       "too many open connections; retry later")


@pytest.mark.parametrize("body", [b"[" * 100000, b'{"kl_coef": ' + b"[" * 100000, b'{"a": ' * 40 + b"1" + b"}" * 40])
def test_deeply_nested_json_is_400_without_a_traceback(parts, caplog, body):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, max_body_bytes=MiB) as srv:
        with caplog.at_level(logging.DEBUG):
            a = call(srv.url, "PATCH", "/v1/state", raw=body, token=TOKEN)
    depth = body.count(b"[") + body.count(b"{")  # every bracket in these bodies opens a level
    assert a.status == 400 and a.json["error"] == (f"request body nests JSON arrays/objects {depth} levels deep; at "
                                                   "most 32 are allowed (control requests need 3)")
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_brackets_inside_strings_do_not_count_as_nesting(server, parts):
    a = call(server.url, "PATCH", "/v1/state", raw=b'{"kl_kind": "' + b"[" * 500 + b'"}', token=TOKEN)
    assert a.status == 400 and list(a.json["errors"]) == ["kl_kind"]  # refused by SharedState, not the depth check


@pytest.mark.parametrize("pieces", [1, 64])  # whole (checked by the app) or in pieces (checked by h11)
def test_head_over_the_limit_is_431(server, pieces):
    raw = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 100) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        step = -(-len(raw) // pieces)
        for i in range(0, len(raw), step):
            s.sendall(raw[i:i + step])
        a = RawReader(s).answer()
    assert a.status == 431 and a.json == {"error": f"request line and headers are over {MAX_HEADER_BYTES} bytes "
                                                   "(the control server's limit)", "status": 431}


def test_keep_alive_connection_gets_a_fresh_deadline_per_request_and_is_dropped_when_idle(parts):
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=1.0) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            reader = RawReader(s)
            for _ in range(3):
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert reader.answer().status == 200
            assert reader.rest() == b""  # idle past the deadline: closed by the server


@pytest.mark.parametrize("body", [b'"' + b'\\"' * 32000, b'"a\\' * 21800], ids=["quote-escapes", "a-escapes"])
def test_pathological_64k_bodies_are_answered_at_once_while_the_server_stays_healthy(parts, body):
    """Four 64 KB bodies of unterminated escaped strings at once: each once cost ~28 s of CPU with the GIL held
    in the string scan of the nesting check (quadratic); every check on a body is linear now, so they are
    answered (400: not JSON) in well under a second each, and /healthz keeps answering meanwhile."""
    assert 60000 < len(body) <= 65536
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, request_timeout=60.0) as srv:
        answers, health, done = [], [], threading.Event()

        def patch():
            answers.append(call(srv.url, "PATCH", "/v1/state", raw=body, token=TOKEN, timeout=60))

        def poll():
            while not done.is_set():
                health.append(call(srv.url, "GET", "/healthz", timeout=60).status)
                done.wait(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        patchers = [threading.Thread(target=patch) for _ in range(4)]
        start = time.monotonic()
        for t in patchers:
            t.start()
        for t in patchers:
            t.join(120)
        elapsed = time.monotonic() - start
        done.set()
        poller.join(60)
    assert [a.status for a in answers] == [400] * 4
    assert all(a.json["error"].startswith("request body is not valid JSON: Unterminated string") for a in answers)
    assert elapsed < 5.0, f"four 64 KB bodies took {elapsed:.1f} s"
    assert health and set(health) == {200}
