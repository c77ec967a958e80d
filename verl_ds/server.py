"""The runtime control plane: a small JSON-over-HTTP server on rank 0 (standard library only).

Routes (docs/http_api.md has the full reference with curl examples):

  GET   /healthz                 liveness, global step, uptime
  GET   /v1/models               OpenAI list shape + verl_ds fields; top-level ``state`` and ``global_step``
  GET   /v1/models/{id}          one model by name or alias (404 with suggestions)
  POST  /v1/models/reward        stage a reward swap (token)          -> reward_swapper.stage_reward_swap
  GET   /v1/state                values, schema, version, pending updates
  GET   /v1/state/{key}          one key with its schema
  PATCH /v1/state                stage hot updates (token)            -> SharedState.stage
  GET   /metrics                 Prometheus text: the latest training metrics and numeric SharedState keys

Safety: mutating routes need ``Authorization: Bearer <token>`` (constant-time comparison); with no token
configured they answer 403 and say how to enable them, and binding a non-loopback address with
mutations enabled and no token is refused. Bodies are size-capped before they are read, every socket
has a timeout, the number of open connections is capped, and any handler exception is answered with a
JSON 500 and logged: the server thread never takes the training loop down with it.
"""
from __future__ import annotations

import difflib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import socket
import tempfile
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from verl_ds.registry import ModelRegistry
from verl_ds.state import STATE_KEYS, SharedState, StateValidationError, UnknownStateKeyError

__all__ = ["ControlServer", "TOKEN_ENV", "URL_FILE", "prometheus_text", "is_loopback"]

log = logging.getLogger(__name__)

TOKEN_ENV = "VERL_DS_SERVER_TOKEN"
URL_FILE = "server_url.txt"
_ENABLE_HINT = (f"mutating routes are disabled because no token is configured; start the run with "
                f"server.token=<secret> or set {TOKEN_ENV}=<secret>, then send 'Authorization: Bearer <secret>'")
# registry names/classes -> the role shown in /v1/models (a model's own ``role`` attribute wins)
_ROLE_NAMES = ("actor", "critic", "ref", "reward")
_ROLE_CLASSES = {"PolicyModel": "actor", "ValueModel": "critic", "RewardModel": "reward", "PPOModel": "algorithm"}


class _HTTPError(Exception):
    """Raised inside a handler to answer ``status`` with a JSON error body."""

    def __init__(self, status: int, message: str, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.headers, self.extra = status, message, dict(headers or {}), extra


def is_loopback(host: str) -> bool:
    """True when ``host`` only reaches this machine (127.0.0.0/8, ::1, or a name resolving only there).

    '' and '0.0.0.0' / '::' mean every interface and are not loopback.
    """
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


# ---- Prometheus ------------------------------------------------------------------------------------------
_PROM_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _prom_name(key: str, prefix: str) -> str:
    name = _PROM_BAD.sub("_", str(key))
    return re.sub(r"_+", "_", f"{prefix}_{name}").rstrip("_")


def _prom_value(v: Any) -> str | None:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    # numpy / torch scalars
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", 0) == 0:
        try:
            return _prom_value(item())
        except Exception:  # noqa: BLE001 - an odd object is skipped, not a 500
            return None
    return None


def _prom_label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def prometheus_text(metrics: dict, state: dict, state_version: int | None = None) -> str:
    """Prometheus text exposition (format 0.0.4) of training metrics and SharedState values.

    metrics: {'actor/pg_loss': 0.1, 'step': 3, ...} -> gauges ``verl_ds_actor_pg_loss`` etc.; non-numeric
    values are skipped, and a name that collides after sanitising keeps its first key. state: numeric
    keys (bools as 0/1) -> ``verl_ds_state_<key>``; the str keys -> labels of ``verl_ds_state_info``.
    """
    lines: list[str] = []
    seen: set[str] = set()

    def gauge(name: str, value: str, help_text: str) -> None:
        if name in seen:
            return
        seen.add(name)
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"])

    for key in sorted(metrics, key=str):
        value = _prom_value(metrics[key])
        if value is not None:
            gauge(_prom_name(key, "verl_ds"), value, f"training metric {_prom_label(key)}")
    info = {}
    for key in sorted(state):
        value = state[key]
        if isinstance(value, str):
            info[key] = value
            continue
        text = _prom_value(value)
        if text is not None:
            desc = STATE_KEYS[key].description if key in STATE_KEYS else "SharedState value"
            gauge(_prom_name(key, "verl_ds_state"), text, f"SharedState {key}: {_prom_label(desc)}")
    if info:
        labels = ",".join(f'{_PROM_BAD.sub("_", k)}="{_prom_label(v)}"' for k, v in sorted(info.items()))
        gauge("verl_ds_state_info{" + labels + "}", "1", "SharedState string values as labels")
    if state_version is not None:
        gauge("verl_ds_shared_state_version", str(int(state_version)), "SharedState version (bumped per change)")
    return "\n".join(lines) + "\n"


# ---- JSON bodies -----------------------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed (JSON numbers must be finite)")


def _parse_json_object(raw: bytes) -> dict:
    if not raw:
        raise _HTTPError(400, "request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _HTTPError(400, f"request body is not UTF-8: {e}") from None
    try:
        body = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError is a ValueError, and so are the hooks' errors
        raise _HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _HTTPError(400, f"request body must be a JSON object, got a JSON {_json_kind(body)}")
    return body


def _json_kind(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


# ---- the server --------------------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with daemon threads, a cap on open connections and logged errors."""

    daemon_threads = True
    block_on_close = False  # stop() must not wait for a stalled client

    def __init__(self, address, handler, control: "ControlServer", max_connections: int):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.control = control
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            # over the cap: answer at once from the accept thread instead of starting another thread
            log.warning("control server: connection limit reached, refusing %s", client_address[0])
            body = b'{"error": "too many open connections; retry later"}'
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        log.exception("control server: error while serving %s", client_address[0])


class ControlServer:
    """The /v1 control-plane HTTP server of a training run (rank 0 only); see the module docstring.

    state, registry: what the routes show and PATCH stages into. host/port: bind address (port 0: any
    free port). token: bearer token for mutating routes; None reads ``VERL_DS_SERVER_TOKEN``; '' or
    unset disables mutations (403). max_body_bytes: larger request bodies get 413. run_dir: where
    ``start()`` writes ``server_url.txt`` (None: nowhere). metrics_fn: returns the latest training
    metrics (``MetricsLogger.snapshot``). reward_swapper: an object with ``stage_reward_swap(spec,
    client) -> {"staged", "applies_at_step"}`` raising ValueError on bad input; None: reward swapping
    answers 501. read_only: disable mutating routes outright (then a non-loopback bind without a token
    is allowed). request_timeout: seconds a connection may stay silent (a stalled client is dropped).
    max_connections: open connections served at once; more get 503.
    """

    def __init__(self, state: SharedState, registry: ModelRegistry, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_body_bytes: int = 65536, run_dir: str | os.PathLike | None = None,
                 metrics_fn: Callable[[], dict] = lambda: {}, reward_swapper: Any = None, read_only: bool = False,
                 request_timeout: float = 10.0, max_connections: int = 64):
        if not isinstance(state, SharedState):
            raise TypeError(f"ControlServer: state must be a SharedState, got {type(state).__name__}")
        if not isinstance(registry, ModelRegistry):
            raise TypeError(f"ControlServer: registry must be a ModelRegistry, got {type(registry).__name__}")
        if not isinstance(host, str):
            raise TypeError(f"ControlServer: host must be a str, got {type(host).__name__} {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"ControlServer: port must be an int in [0, 65535] (0: any free port), got {port!r}")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"ControlServer: max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
        if not (isinstance(request_timeout, (int, float)) and request_timeout > 0):
            raise ValueError(f"ControlServer: request_timeout must be a number of seconds > 0, got {request_timeout!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"ControlServer: max_connections must be an int >= 1, got {max_connections!r}")
        if not callable(metrics_fn):
            raise TypeError(f"ControlServer: metrics_fn must be callable, got {type(metrics_fn).__name__}")
        if reward_swapper is not None and not callable(getattr(reward_swapper, "stage_reward_swap", None)):
            raise TypeError("ControlServer: reward_swapper must have a stage_reward_swap(spec, client) method, got "
                            f"{type(reward_swapper).__name__}")
        if token is None:
            token = os.environ.get(TOKEN_ENV)
        if token is not None and not isinstance(token, str):
            raise TypeError(f"ControlServer: token must be a str, got {type(token).__name__}")
        token = (token or "").strip() or None
        if not read_only and token is None and not is_loopback(host):
            raise ValueError(
                f"ControlServer: refusing to bind non-loopback host {host!r} with mutating routes enabled and no "
                f"token: anyone who can reach it could change the run. Set server.token=<secret> (or {TOKEN_ENV}), "
                "or bind server.host=127.0.0.1")
        self.state, self.registry = state, registry
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.metrics_fn, self.reward_swapper = metrics_fn, reward_swapper
        self.read_only, self.request_timeout, self.max_connections = read_only, float(request_timeout), max_connections
        self._token = None if token is None else token.encode("utf-8")
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self.url: str | None = None

    @property
    def mutations_enabled(self) -> bool:
        return not self.read_only and self._token is not None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind, serve in a daemon thread, write ``<run_dir>/server_url.txt``; returns the URL."""
        if self._httpd is not None:
            raise RuntimeError(f"ControlServer already started at {self.url}")
        handler = type("_BoundHandler", (_Handler,), {"timeout": self.request_timeout})
        try:
            httpd = _Server((self.host, self.port), handler, self, self.max_connections)
        except OSError as e:
            raise OSError(e.errno, f"ControlServer: cannot bind {self.host}:{self.port}: {e.strerror or e}") from e
        host, port = httpd.server_address[:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        if ":" in shown and not shown.startswith("["):
            shown = f"[{shown}]"
        self._httpd, self.port, self._started_at = httpd, port, time.time()
        self.url = f"http://{shown}:{port}"
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="verl_ds-control-server", daemon=True)
        self._thread.start()
        if self.run_dir is not None:
            self._write_url_file()
        log.info("control server listening on %s (mutations %s)", self.url,
                 "read-only" if self.read_only else ("enabled with a token" if self._token else "disabled: no token"))
        return self.url

    def stop(self) -> None:
        """Stop serving, close the socket and remove the URL file (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.run_dir is not None:
            path = os.path.join(self.run_dir, URL_FILE)
            try:
                with open(path, encoding="utf-8") as fh:
                    ours = fh.read().strip() == self.url
                if ours:
                    os.unlink(path)
            except OSError:
                pass

    def __enter__(self) -> "ControlServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _write_url_file(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".server_url.", dir=self.run_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(self.url + "\n")
        os.replace(tmp, os.path.join(self.run_dir, URL_FILE))

    # ---- auth --------------------------------------------------------------------------------------------
    def check_auth(self, header: str | None) -> None:
        """Raise _HTTPError 403 (mutations off) or 401 (missing / wrong token) unless ``header`` authorises."""
        if self.read_only:
            raise _HTTPError(403, "this server is read-only (started with read_only=True); mutating routes are off")
        if self._token is None:
            raise _HTTPError(403, _ENABLE_HINT)
        challenge = {"WWW-Authenticate": 'Bearer realm="verl_ds"'}
        if not header:
            raise _HTTPError(401, "missing 'Authorization: Bearer <token>' header", challenge)
        scheme, _, given = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise _HTTPError(401, "Authorization header must be 'Bearer <token>'", challenge)
        if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), self._token):
            raise _HTTPError(401, "invalid token", challenge)

    # ---- views -------------------------------------------------------------------------------------------
    def model_entry(self, info: dict) -> dict:
        """One /v1/models entry: the OpenAI fields plus verl_ds's."""
        model = self.registry.get(info["name"], None)
        return {"id": info["name"], "object": "model", "created": int(info["registered_at"]), "owned_by": "verl_ds",
                "role": _role_of(info["name"], info["aliases"], model), "aliases": info["aliases"],
                "class": info["class"], "version": info["version"], "trainable": info["trainable"],
                "num_parameters": info["num_parameters"]}

    def models_view(self) -> dict:
        state = self.state.snapshot()
        return {"object": "list", "data": [self.model_entry(i) for i in self.registry.snapshot()],
                "state": state, "state_version": self.state.version, "global_step": state["global_step"]}

    def model_view(self, model_id: str) -> dict:
        snapshot = self.registry.snapshot()
        for info in snapshot:
            if model_id == info["name"] or model_id in info["aliases"]:
                return self.model_entry(info)
        pool = sorted({i["name"] for i in snapshot} | {a for i in snapshot for a in i["aliases"]})
        close = difflib.get_close_matches(model_id, pool, n=3, cutoff=0.5)
        # 'reward_model_v2' vs 'reward': a shared prefix counts too (as in ModelRegistry's message)
        close += [p for p in pool if p not in close and min(len(p), len(model_id)) >= 3
                  and (p.startswith(model_id) or model_id.startswith(p))]
        close = close[:3]
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise _HTTPError(404, f"model {model_id!r} is not registered{hint}", suggestions=close,
                         models=[i["name"] for i in snapshot], aliases=self.registry.aliases())

    def state_view(self) -> dict:
        values = self.state.snapshot()
        return {"values": values, "schema": self.state.schema(), "version": self.state.version,
                "global_step": values["global_step"], "pending": self.state.staged()}

    def state_key_view(self, key: str) -> dict:
        try:
            value = self.state.get(key)
        except UnknownStateKeyError as e:
            close = difflib.get_close_matches(key, list(STATE_KEYS), n=3, cutoff=0.6)
            raise _HTTPError(404, str(e), suggestions=close) from None
        return {"key": key, "value": value, "schema": STATE_KEYS[key].schema(), "version": self.state.version}

    def health_view(self) -> dict:
        return {"status": "ok", "global_step": self.state.get("global_step"), "state_version": self.state.version,
                "uptime_s": round(time.time() - (self._started_at or time.time()), 3),
                "mutations": "enabled" if self.mutations_enabled else "disabled"}

    def patch_state(self, body: dict, client: str) -> dict:
        if not body:
            raise _HTTPError(400, "empty update: send a JSON object of {key: value} with at least one key; "
                             "GET /v1/state lists the hot-updatable keys")
        try:
            result = self.state.stage(body, client=client)
        except StateValidationError as e:
            raise _HTTPError(400, str(e), errors=e.errors) from None
        log.info("control server: %s staged %s for step %s", client, result["staged"], result["applies_at_step"])
        return {**result, "status": "staged"}

    def swap_reward(self, body: dict, client: str) -> dict:
        if self.reward_swapper is None:
            raise _HTTPError(501, "reward swapping is not available: this server has no reward_swapper "
                             "(the trainer provides one)")
        try:
            result = self.reward_swapper.stage_reward_swap(body, client)
        except (ValueError, TypeError) as e:
            raise _HTTPError(400, str(e)) from None
        log.info("control server: %s staged a reward swap %s", client, result)
        return {**result, "status": "staged"}

    def metrics_view(self) -> str:
        return prometheus_text(dict(self.metrics_fn() or {}), self.state.snapshot(), self.state.version)


def _role_of(name: str, aliases: list[str], model: Any) -> str | None:
    role = getattr(model, "role", None)
    if isinstance(role, str) and role:
        return role
    for n in (name, *aliases):
        if n in _ROLE_NAMES:
            return n
    for cls in type(model).__mro__:
        if cls.__name__ in _ROLE_CLASSES:
            return _ROLE_CLASSES[cls.__name__]
    return None


# ---- routing ---------------------------------------------------------------------------------------------
_GET = ("GET", "HEAD")


class _Handler(BaseHTTPRequestHandler):
    """One connection; every method funnels into ``_dispatch`` (``__getattr__`` catches any ``do_X``)."""

    protocol_version = "HTTP/1.1"
    server_version = "verl_ds-control"
    sys_version = ""
    timeout = 10.0  # replaced per server in ControlServer.start

    @property
    def control(self) -> ControlServer:
        return self.server.control

    def __getattr__(self, name: str):
        if name.startswith("do_"):
            return self._dispatch
        raise AttributeError(name)

    # ---- response helpers ------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        if not self._body_read and self._has_body():
            # an unread body (401 before reading it, a GET with a body) would be parsed as the next request
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict | None = None) -> None:
        body = (json.dumps(obj, default=str, indent=1) + "\n").encode("utf-8")
        self._send(status, body, "application/json", headers)

    def send_error(self, code, message=None, explain=None):
        """Errors raised by the base class (bad request line, headers too large, ...) as JSON too."""
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        text = message or phrase
        if explain:
            text = f"{text}: {explain}"
        # the base class may call this before it has parsed a command
        if not hasattr(self, "command") or self.command is None:
            self.command = ""
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # a 0.9 answer has no status line; nobody speaks 0.9 to us
        self._send_json(code, {"error": text, "status": code})

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue`` (curl sends it for bodies over 1 KiB): refuse an oversized body before
        the client sends it instead of inviting it with '100 Continue'."""
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = 0
        limit = self.control.max_body_bytes
        if n > limit:
            self.command = self.command or ""
            self.close_connection = True
            self._send_safely(413, {"error": f"request body of {n} bytes is over the limit of {limit} bytes "
                                    "(server.max_body_bytes)", "status": 413})
            return False
        return super().handle_expect_100()

    def log_message(self, fmt, *args):  # per-request lines would flood the training log
        log.debug("control server %s: " + fmt, self.address_string(), *args)

    def log_error(self, fmt, *args):
        log.warning("control server %s: " + fmt, self.address_string(), *args)

    # ---- body --------------------------------------------------------------------------------------------
    _body_read = False

    def _has_body(self) -> bool:
        headers = getattr(self, "headers", None)
        if headers is None:
            return False
        return headers.get("Content-Length", "0").strip() not in ("", "0") or "Transfer-Encoding" in headers

    def _read_body(self) -> bytes:
        limit = self.control.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked(limit)
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise _HTTPError(411, "Content-Length header required (or Transfer-Encoding: chunked)")
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise _HTTPError(400, f"invalid Content-Length {length!r}") from None
        if n > limit:
            self.close_connection = True  # the unread body is still in the socket
            raise _HTTPError(413, f"request body of {n} bytes is over the limit of {limit} bytes (server.max_body_bytes)")
        data = self._read_exact(n)
        self._body_read = True
        return data

    def _read_exact(self, n: int) -> bytes:
        try:
            data = self.rfile.read(n)
        except (TimeoutError, socket.timeout):
            self.close_connection = True
            raise _HTTPError(408, f"timed out after {self.timeout:g} s waiting for the request body") from None
        if len(data) < n:
            self.close_connection = True
            raise _HTTPError(400, f"request body ended after {len(data)} of {n} bytes")
        return data

    def _read_chunked(self, limit: int) -> bytes:
        parts, total = [], 0
        try:
            while True:
                line = self.rfile.readline(66)
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    self.close_connection = True
                    raise _HTTPError(400, f"malformed chunk size line {line[:32]!r}") from None
                if size == 0:
                    while self.rfile.readline(1026) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    self._body_read = True
                    return b"".join(parts)
                total += size
                if total > limit:
                    self.close_connection = True
                    raise _HTTPError(413, f"chunked request body is over the limit of {limit} bytes "
                                     "(server.max_body_bytes)")
                parts.append(self._read_exact(size))
                self.rfile.readline(3)  # CRLF after the chunk
        except (TimeoutError, socket.timeout):
            self.close_connection = True
            raise _HTTPError(408, f"timed out after {self.timeout:g} s waiting for the request body") from None

    # ---- dispatch ----------------------------------------------------------------------------------------
    def _route(self, path: str):
        """(allowed methods, {method: callable()}) for a path, or None when no route matches."""
        c = self.control
        if path == "/healthz":
            return {m: lambda: (200, c.health_view()) for m in _GET}
        if path == "/metrics":
            return {m: lambda: (200, c.metrics_view()) for m in _GET}
        if path == "/v1/models":
            return {m: lambda: (200, c.models_view()) for m in _GET}
        if path == "/v1/state":
            routes = {m: lambda: (200, c.state_view()) for m in _GET}
            routes["PATCH"] = lambda: (202, c.patch_state(self._mutation_body(), self.client_address[0]))
            return routes
        if path.startswith("/v1/state/") and len(path) > len("/v1/state/"):
            key = unquote(path[len("/v1/state/"):])
            return {m: lambda: (200, c.state_key_view(key)) for m in _GET}
        if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
            model_id = unquote(path[len("/v1/models/"):])
            routes = {m: lambda: (200, c.model_view(model_id)) for m in _GET}
            if model_id == "reward":
                routes["POST"] = lambda: (202, c.swap_reward(self._mutation_body(), self.client_address[0]))
            return routes
        return None

    def _mutation_body(self) -> dict:
        self.control.check_auth(self.headers.get("Authorization"))
        return _parse_json_object(self._read_body())

    def _dispatch(self) -> None:
        self._body_read = False  # per request: a keep-alive connection reuses the handler
        path = urlsplit(self.path).path
        if len(path) > 1:
            path = path.rstrip("/")
        try:
            routes = self._route(path)
            if routes is None:
                raise _HTTPError(404, f"no route {path!r}; routes: GET /healthz, GET /metrics, GET /v1/models, "
                                 "GET /v1/models/{id}, POST /v1/models/reward, GET|PATCH /v1/state, GET /v1/state/{key}")
            view = routes.get(self.command)
            if view is None:
                allow = ", ".join(routes)
                raise _HTTPError(405, f"method {self.command} not allowed on {path}; allowed: {allow}",
                                 {"Allow": allow})
            status, body = view()
            if isinstance(body, str):
                self._send(status, body.encode("utf-8"), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send_json(status, body)
        except _HTTPError as e:
            self._send_safely(e.status, {"error": e.message, "status": e.status, **e.extra}, e.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - any bug in a view is a 500, never a dead server thread
            log.exception("control server: %s %s failed", self.command, path)
            self.close_connection = True
            self._send_safely(500, {"error": f"internal server error: {type(e).__name__}: {e}", "status": 500})

    def _send_safely(self, status: int, obj: dict, headers: dict | None = None) -> None:
        try:
            self._send_json(status, obj, headers)
        except OSError:
            self.close_connection = True
