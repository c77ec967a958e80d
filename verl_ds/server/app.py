"""The control server's ASGI application: request limits, authentication, body reading and answers. It never blocks
the event loop: views run in daemon worker threads, bodies have a whole-body deadline, and past ``max_connections``
requests in progress the answer is 503 at once."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from verl_ds.server.jsonio import HTTPError, dumps, parse_json_object
from verl_ds.server.protocol import (BODY_ANNOUNCED, BODY_TRUNCATED, HEAD_TOO_LARGE, MAX_HEADER_BYTES, check_framing,
                                     warn_throttled)
from verl_ds.server.views import ROUTE_LIST, resolve, shown_method
from verl_ds.threads import DaemonPool

__all__ = ["ControlApp"]

log = logging.getLogger("verl_ds.server")


class _ClientGone(Exception):
    """The client disconnected: nobody is left to answer."""


class _Request:
    """What the app needs from an ASGI scope."""

    def __init__(self, scope: dict):
        self.scope = scope
        self.method: str = scope["method"]
        self.path: str = (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1")
        self.client: str = (scope.get("client") or ("",))[0]
        self.headers: dict[str, list[str]] = {}
        # h11 only limits a head that arrives in pieces; one that arrives whole is measured here
        self.head_bytes = len(self.path) + len(scope.get("query_string", b"")) + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        for name, value in scope["headers"]:
            self.headers.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
        self.body_done = not self.has_body

    def header(self, name: str) -> str | None:
        values = self.headers.get(name)
        return values[0] if values else None

    @property
    def has_body(self) -> bool:
        length = self.header("content-length")
        return (length is not None and length.strip() != "0") or "transfer-encoding" in self.headers


class ControlApp:
    """ASGI 3 application of one ``ControlServer`` (``control``; that module imports this one, never the reverse)."""

    def __init__(self, control: Any, pool: DaemonPool):
        self.control, self.pool = control, pool
        self.in_progress = 0  # only touched on the event loop

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return
        started = asyncio.get_running_loop().time()
        req = _Request(scope)
        if self.in_progress >= self.control.max_connections:
            warn_throttled("requests", "control server: %d requests in progress (server max_connections), refusing "
                           "more with 503 (e.g. %s %s from %s)", self.in_progress, req.method, req.path[:100], req.client)
            await self._answer(send, req, 503, {"error": f"too many requests in progress (at most "
                                                         f"{self.control.max_connections}); retry later",
                                                "status": 503}, {"Retry-After": "1"}, close=True)
            return
        self.in_progress += 1
        try:
            answer = await self._serve(req, receive, started)
        except (_ClientGone, asyncio.CancelledError):  # gone, or the server is stopping: nobody to answer
            return
        finally:
            self.in_progress -= 1  # before answering: a client that has its answer finds the slot free
        await self._answer(send, req, *answer)

    async def _serve(self, req: _Request, receive: Callable, started: float) -> tuple:
        """(status, payload, headers, close) for one request."""
        try:
            if req.head_bytes > MAX_HEADER_BYTES:
                raise HTTPError(431, HEAD_TOO_LARGE, close=True)
            check_framing(req.scope["http_version"], req.headers)
            route = resolve(req.path)
            if route is None:  # the path is not repeated back (views' docstring)
                raise HTTPError(404, f"no route for this path; routes: {ROUTE_LIST}")
            handler = route.handlers.get(req.method)
            if handler is None:
                allow = ", ".join(route.handlers)
                raise HTTPError(405, f"{shown_method(req.method)} not allowed on {route.name}; allowed: {allow}",
                                {"Allow": allow})
            body = None
            if handler.mutating:
                self.control.check_auth(req.headers.get("authorization", []))
                raw = await self._read_body(req, receive, started)
                body = await asyncio.wrap_future(self.pool.submit(parse_json_object, raw))
            status, payload = await asyncio.wrap_future(
                self.pool.submit(handler.fn, self.control, route.arg, body, req.client))
            return status, payload, None, False
        except HTTPError as e:
            return e.status, {"error": e.message, "status": e.status, **e.extra}, e.headers, e.close
        except _ClientGone:
            raise
        except Exception as e:  # noqa: BLE001 - any bug in a view is a 500, never a dead server
            log.exception("control server: %s %s failed", req.method, req.path[:200])
            return 500, {"error": f"internal server error: {type(e).__name__}: {e}", "status": 500}, None, True

    async def _read_body(self, req: _Request, receive: Callable, started: float) -> bytes:
        """The whole body within ``request_timeout`` of the head and ``max_body_bytes``, whatever the framing (a
        chunked body is counted as it arrives: only the limit is ever buffered)."""
        limit, timeout = self.control.max_body_bytes, self.control.request_timeout
        length = req.header("content-length")
        if length is None and "transfer-encoding" not in req.headers:
            raise HTTPError(411, "Content-Length header required (or Transfer-Encoding: chunked)", close=True)
        if length is not None and int(length) > limit:  # h11 has checked it is a number
            raise HTTPError(413, f"request body of {int(length)} bytes is over the limit of {limit} bytes",
                            close=True)
        loop = asyncio.get_running_loop()
        parts, total = [], 0
        while True:
            remaining = started + timeout - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except asyncio.TimeoutError:
                raise HTTPError(408, f"timed out after {timeout:g} s waiting for the request body", close=True) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            total += len(chunk)
            # a chunk's size line is enough: 'FFFFFFFFFFFFFFFF' is refused before any of its bytes arrive
            if max(total, req.scope.get(BODY_ANNOUNCED, 0)) > limit:
                raise HTTPError(413, f"{'chunked ' if length is None else ''}request body is over the limit of "
                                     f"{limit} bytes", close=True)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        if req.scope.get(BODY_TRUNCATED):
            expected = f"of {length} bytes" if length is not None else "before the last chunk"
            raise HTTPError(400, f"request body ended after {total} bytes {expected}: the client closed its side",
                            close=True)
        req.body_done = True
        return b"".join(parts)

    async def _answer(self, send: Callable, req: _Request, status: int, payload: Any,
                      headers: dict | None = None, close: bool = False) -> None:
        if isinstance(payload, str):
            body, content_type = payload.encode("utf-8"), "text/plain; version=0.0.4; charset=utf-8"
        else:
            body, content_type = dumps(payload), "application/json"
        body = self.control.redact_bytes(body)
        # an unread body (401 before reading it, a GET with a body) must not be parsed as the next request
        close = close or not req.body_done
        out = [("content-type", content_type), ("content-length", str(len(body))), ("cache-control", "no-store")]
        out += [(k.lower(), str(v)) for k, v in (headers or {}).items()]
        if close:
            out.append(("connection", "close"))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
