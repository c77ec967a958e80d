"""The control server's connections: uvicorn's h11 protocol with the limits it lacks (docs/http_api.md, "Limits"):
uvicorn resets its idle timeout on every byte, so one trickling client could hold a connection forever. Added: a
whole-head deadline, a cap on open sockets evicting the longest idle, chunked bodies refused from their size line,
errors never echoing header values (they may hold the token), a lingering close so an uploader reads its 413."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from verl_ds.server.jsonio import HTTPError

__all__ = ["ControlProtocol", "ConnectionLimits", "BODY_TRUNCATED", "BODY_ANNOUNCED", "check_framing",
           "describe_protocol_error", "raw_json_response", "MAX_HEADER_BYTES", "HEAD_TOO_LARGE", "warn_throttled"]

log = logging.getLogger("verl_ds.server")

MAX_HEADER_BYTES = 16384  # request line + headers; more is answered 431
# scope key set when the client closed its side before the request body was complete
BODY_TRUNCATED = "verl_ds.body_truncated"
# scope key: the body size a chunked request has announced so far (bytes received + the rest of the current
# chunk, from its size line); the app refuses it at once when that is over the limit
BODY_ANNOUNCED = "verl_ds.body_announced"
HEAD_TOO_LARGE = f"request line and headers are over {MAX_HEADER_BYTES} bytes (the control server's limit)"
# h11 quotes the offending bytes ("illegal header line: b'...'", "bytearray(b'...')"): cut from there on
_VALUE_REPR = re.compile(r"(\s*:)?\s*(bytearray\(|\bb['\"]).*$", re.DOTALL)


@dataclass(frozen=True)
class ConnectionLimits:
    request_timeout: float  # seconds for a request head (from connect / the previous answer)
    max_open_connections: int  # more are answered 503 at once
    linger_s: float  # how long unread input is drained after a closing answer


def describe_protocol_error(exc: BaseException | None) -> str:
    """h11's reason for refusing a request, without the offending bytes (a header value may be a token)."""
    text = str(exc) if exc is not None else ""
    text = _VALUE_REPR.sub("", text).strip() or "unparseable request"
    return f"malformed HTTP/1.1 request: {text}"


def check_framing(http_version: str, headers: dict) -> None:
    """HTTPError for what h11 lets through: a major version other than 1 (505: 'PRI * HTTP/2.0' parses), and both
    Content-Length and Transfer-Encoding (400, RFC 9112 section 6.3: request smuggling). Echoes nothing."""
    if http_version.partition(".")[0] != "1":
        raise HTTPError(505, "HTTP version not supported: this server speaks HTTP/1.1 (and 1.0)", close=True)
    if "content-length" in headers and "transfer-encoding" in headers:
        raise HTTPError(400, "malformed HTTP/1.1 request: both Content-Length and Transfer-Encoding are set; send "
                             "one of them", close=True)


def raw_json_response(status: int, message: str, extra_headers: tuple = ()) -> bytes:
    """A complete ``Connection: close`` answer as bytes, for answers given outside a request cycle."""
    body = (json.dumps({"error": message, "status": status}, indent=1) + "\n").encode()
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
               ("Cache-Control", "no-store"), ("Connection", "close"), *extra_headers]
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1") + body


_last_warned: dict[str, float] = {}


def warn_throttled(kind: str, msg: str, *args, every_s: float = 10.0) -> None:
    """A warning at most once per ``every_s`` seconds per ``kind`` (overload must not flood the training log)."""
    now = time.monotonic()
    if now - _last_warned.get(kind, -every_s) >= every_s:
        _last_warned[kind] = now
        log.warning(msg, *args)
    else:
        log.debug(msg, *args)


class _QuietLog(logging.LoggerAdapter):
    """uvicorn's per-request warnings at debug level: the client gets its 400; a hostile one cannot flood the log."""

    @property
    def level(self) -> int:  # uvicorn reads ``logger.level`` to decide on its trace messages
        return self.logger.level

    def warning(self, msg, *args, **kwargs) -> None:
        self.debug(msg, *args, **kwargs)


class _LingeringTransport:
    """A transport whose ``close()`` shuts the write side, then drains the client's input for ``linger_s``."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, linger_s: float,
                 on_closing: Callable[[], None]):
        self._t, self._loop, self._linger_s, self._on_closing = transport, loop, linger_s, on_closing
        self.lingering = False
        self.peer_closed = False  # the client has shut its sending side: nothing left to drain
        self._timer: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        self.lingering = True
        self._on_closing()  # before the FIN: a client that saw EOF finds its slot already free
        if self.peer_closed:
            self._t.close()  # flushes the answer, then closes
            return
        try:
            if not self._t.can_write_eof():
                self._t.close()
                return
            self._t.write_eof()
            if not self._t.is_reading():
                self._t.resume_reading()
        except (OSError, RuntimeError):
            self._t.abort()
            return
        self._timer = self._loop.call_later(self._linger_s, self._t.close)

    def hard_close(self, graceful: bool = False) -> None:
        """Close now: an abort (a dropped client, server shutdown), or with ``graceful`` a FIN for an idle connection
        (RFC 9112 section 9.5); neither lingers."""
        self.lingering = True
        self._on_closing()
        if self._timer is not None:
            self._timer.cancel()
        (self._t.close if graceful else self._t.abort)()

    def finished(self) -> None:
        """The client closed its side too (or the connection is gone): no need to linger any longer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._t.is_closing():
            self._t.close()

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._t, name)


class ControlProtocol(H11Protocol):
    """uvicorn's H11Protocol plus the limits of the module docstring; one per connection."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.logger = _QuietLog(log, {})  # under our logger (token redaction), never uvicorn's
        self.access_log = False  # per-request lines would flood the training log
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._protocol_error: BaseException | None = None
        self.conn.next_event = functools.partial(self._next_event, self.conn.next_event)
        self._idle_since = self.loop.time()  # when this connection last had no request in progress
        self._body_bytes = 0  # of the current request, received so far

    def _next_event(self, next_event: Callable):
        """h11's next event; keeps a protocol error for the answer and publishes a chunked body's announced size
        as soon as a chunk's size line is read (``BODY_ANNOUNCED``)."""
        try:
            event = next_event()
        except h11.RemoteProtocolError as e:  # uvicorn drops h11's exception before answering 400
            self._protocol_error = e
            raise
        if isinstance(event, h11.Request):
            self._body_bytes = 0
            return event
        if isinstance(event, h11.Data):
            self._body_bytes += len(event.data)
        # h11 keeps the rest of the current chunk in its reader (h11 >= 0.16, setup.py pins it); no public API
        pending = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
        cycle = self.cycle
        if isinstance(pending, int) and pending > 0 and cycle is not None and not cycle.response_complete:
            announced = self._body_bytes + pending
            if announced > cycle.scope.get(BODY_ANNOUNCED, 0):  # type: ignore[attr-defined]
                cycle.scope[BODY_ANNOUNCED] = announced  # type: ignore[literal-required]
                cycle.message_event.set()  # the app compares it with its limit now, not when the bytes arrive
        return event

    # ---- connection lifecycle --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        wrapped = _LingeringTransport(transport, self.loop, self.limits.linger_s,
                                      functools.partial(self.connections.discard, self))
        if len(self.connections) >= self.limits.max_open_connections and not self._evict_longest_idle():
            self._refused = True
            self.transport = wrapped  # type: ignore[assignment]
            warn_throttled("connections", "control server: %d connections open (server max_open_connections), "
                           "refusing more with 503", len(self.connections))
            transport.write(raw_json_response(503, "too many open connections; retry later", (("Retry-After", "1"),)))
            wrapped.close()
            return
        super().connection_made(wrapped)  # type: ignore[arg-type]
        self._arm_deadline()

    def _idle(self) -> bool:
        """No request in progress: nothing sent yet, part of a head, or between keep-alive requests."""
        return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

    def _evict_longest_idle(self) -> bool:
        """At the cap, close the connection idle longest (no request of it is lost) for the new one; False if each
        has a request in progress. A client that sends as it connects is never the longest idle: no lock-out."""
        idle = [c for c in self.connections if isinstance(c, ControlProtocol) and c._idle()]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c._idle_since)
        warn_throttled("evictions", "control server: %d connections open (server max_open_connections): closing the "
                       "longest idle one (%s, idle %.1f s) for a new client", len(self.connections), victim.client,
                       self.loop.time() - victim._idle_since)
        victim._disarm_deadline()
        victim.transport.hard_close(graceful=True)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        if isinstance(self.transport, _LingeringTransport):
            self.transport.finished()
        if self._refused:
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self.transport.is_closing():
            return  # lingering: the answer is sent, the rest of the input is dropped
        super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused or self.transport.is_closing():
            self.transport.finished()
            return None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # a half-closed client still waits for its answer; a body cut short can never complete
            cycle.keep_alive = False
            self.transport.peer_closed = True
            if cycle.more_body:
                cycle.scope[BODY_TRUNCATED] = True  # type: ignore[literal-required]
                cycle.more_body = False
                cycle.message_event.set()
            return True
        return None  # idle, or in the middle of a head that can never complete: close

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()  # before a pipelined request may start in super()
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()  # the next request on this keep-alive connection gets a fresh deadline

    def shutdown(self) -> None:
        """Server shutdown: drop the connection at once, even mid-request (stop() must not wait)."""
        self._disarm_deadline()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.hard_close()

    # ---- deadlines ---------------------------------------------------------------------------------------
    def _arm_deadline(self) -> None:
        self._disarm_deadline()
        self._deadline = self.loop.call_later(self.limits.request_timeout, self._deadline_passed)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request head arrived: the app bounds the body and the answer
        if not self.transport.is_closing():
            log.debug("control server: dropping %s: no complete request within %g s", self.client,
                      self.limits.request_timeout)
            self.transport.hard_close()

    # ---- protocol errors -------------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        error = self._protocol_error
        status = getattr(error, "error_status_hint", 400)
        status = status if isinstance(status, int) and 400 <= status < 600 else 400
        message = HEAD_TOO_LARGE if status == 431 else describe_protocol_error(error)
        self.transport.write(raw_json_response(status, message))
        self.transport.close()
