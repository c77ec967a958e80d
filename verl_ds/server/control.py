"""ControlServer: the /v1 control plane of a training run, served by uvicorn on a daemon thread (rank 0)."""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Iterable

from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState

from verl_ds.config import TOKEN_ENV, is_loopback  # one definition for the config gate and the server
from verl_ds.registry import ModelRegistry
from verl_ds.server.app import ControlApp
from verl_ds.server.jsonio import HTTPError
from verl_ds.server.protocol import MAX_HEADER_BYTES, ConnectionLimits, ControlProtocol
from verl_ds.state import SharedState
from verl_ds.threads import DaemonPool

__all__ = ["ControlServer", "TOKEN_ENV", "URL_FILE", "is_loopback", "MAX_HEADER_BYTES"]

log = logging.getLogger("verl_ds.server")

URL_FILE = "server_url.txt"
_WORKERS = 4  # threads running views; more requests wait in the queue (up to max_connections in progress)
_ENABLE_HINT = (f"mutating routes are disabled because no token is configured; start the run with "
                f"server.token=<secret> or set {TOKEN_ENV}=<secret>, then send 'Authorization: Bearer <secret>'")
_REDACTED = "<redacted>"


class _RedactToken(logging.Filter):
    """Replaces the server's token in every record of the 'verl_ds.server' logger (message and traceback)."""

    def __init__(self, server: "ControlServer"):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = self.server.redact(text)
        if clean != text:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.server.redact(record.exc_text)
        return True


def _check_int(name: str, value: Any, low: int, high: int | None = None, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"ControlServer: {name} must be an int {bound}{what}, got {value!r}")


class ControlServer:
    """The /v1 control-plane HTTP server of a training run (rank 0); routes and limits: docs/http_api.md.
    ``token`` None reads ``VERL_DS_SERVER_TOKEN``; without one (or with ``read_only``) mutating routes answer 403,
    and a non-loopback host needs a token unless ``read_only``. ``reward_swapper.stage_reward_swap(spec, client=)``
    stages swaps (None: 501) within ``swappable_rewards``, ``allow_reward_code``, ``reward_model_dir``."""

    def __init__(self, state: SharedState, registry: ModelRegistry, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_body_bytes: int = 65536, run_dir: str | os.PathLike | None = None,
                 metrics_fn: Callable[[], dict] = lambda: {}, reward_swapper: Any = None, read_only: bool = False,
                 request_timeout: float = 10.0, max_connections: int = 64, max_open_connections: int = 256,
                 backlog: int = 1024, swappable_rewards: Iterable[str] = (), allow_reward_code: bool = False,
                 reward_model_dir: str | os.PathLike | None = None, policy_vocab_size: int | None = None):
        if not isinstance(state, SharedState):
            raise TypeError(f"ControlServer: state must be a SharedState, got {type(state).__name__}")
        if not isinstance(registry, ModelRegistry):
            raise TypeError(f"ControlServer: registry must be a ModelRegistry, got {type(registry).__name__}")
        if not isinstance(host, str):
            raise TypeError(f"ControlServer: host must be a str, got {type(host).__name__} {host!r}")
        _check_int("port", port, 0, 65535, " (0: any free port)")
        _check_int("max_body_bytes", max_body_bytes, 1)
        if isinstance(request_timeout, bool) or not isinstance(request_timeout, (int, float)) or not request_timeout > 0:
            raise ValueError(f"ControlServer: request_timeout must be a number of seconds > 0, got {request_timeout!r}")
        _check_int("max_connections", max_connections, 1)
        _check_int("max_open_connections", max_open_connections, 1)
        _check_int("backlog", backlog, 1)
        if policy_vocab_size is not None:
            _check_int("policy_vocab_size", policy_vocab_size, 1)
        if not callable(metrics_fn):
            raise TypeError(f"ControlServer: metrics_fn must be callable, got {type(metrics_fn).__name__}")
        if reward_swapper is not None and not callable(getattr(reward_swapper, "stage_reward_swap", None)):
            raise TypeError("ControlServer: reward_swapper must have a stage_reward_swap(spec, client) method, got "
                            f"{type(reward_swapper).__name__}")
        if isinstance(swappable_rewards, str) or not all(isinstance(s, str) and s for s in swappable_rewards):
            raise TypeError(f"ControlServer: swappable_rewards must be a list of reward specs (non-empty str), "
                            f"got {swappable_rewards!r}")
        if not isinstance(allow_reward_code, bool):
            raise TypeError(f"ControlServer: allow_reward_code must be a bool, got {allow_reward_code!r}")
        if reward_model_dir is not None and not os.path.isdir(reward_model_dir):
            raise ValueError(f"ControlServer: reward_model_dir {os.fspath(reward_model_dir)!r} is not a directory")
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
        self.read_only, self.request_timeout = read_only, float(request_timeout)
        self.max_connections, self.max_open_connections, self.backlog = max_connections, max_open_connections, backlog
        self.swappable_rewards = tuple(swappable_rewards)
        self.allow_reward_code = allow_reward_code
        self.reward_model_dir = None if reward_model_dir is None else os.path.realpath(reward_model_dir)
        self.policy_vocab_size = policy_vocab_size
        self._token = token
        self._token_forms = self._forms(token)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: DaemonPool | None = None
        self._filter = _RedactToken(self)
        self.started_at: float | None = None
        self.url: str | None = None

    @property
    def mutations_enabled(self) -> bool:
        return not self.read_only and self._token is not None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind, serve on a daemon thread, write ``<run_dir>/server_url.txt``; returns the URL."""
        with self._lock:
            if self._loop is not None:
                raise RuntimeError(f"ControlServer already started at {self.url}")
            sock = self._bind()
            log.addFilter(self._filter)
            if self.allow_reward_code:
                log.warning("control server: !!! server.allow_reward_code=true: anyone with the token can make every "
                            "rank import and run arbitrary Python code via POST /v1/models/reward !!!")
            self._pool = DaemonPool(_WORKERS, "verl_ds-control-view")
            loop = asyncio.new_event_loop()
            ready: dict = {}
            started = threading.Event()
            self._thread = threading.Thread(target=self._serve, args=(loop, sock, ready, started),
                                            name="verl_ds-control-server", daemon=True)
            self._thread.start()
            started.wait(60)
            if "error" in ready or not started.is_set():
                self._pool.shutdown()
                log.removeFilter(self._filter)
                sock.close()
                raise RuntimeError(f"ControlServer: the server thread did not start: {ready.get('error')!r}")
            self._loop, self.started_at = loop, time.time()
            if self.run_dir is not None:
                self._write_url_file()
        log.info("control server listening on %s (mutations %s)", self.url,
                 "read-only" if self.read_only else ("enabled with a token" if self._token else "disabled: no token"))
        return self.url

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(self.backlog)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"ControlServer: cannot bind {self.host}:{self.port}: {e.strerror or e}") from e
        host, port = sock.getsockname()[:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        if ":" in shown and not shown.startswith("["):
            shown = f"[{shown}]"
        self.port, self.url = port, f"http://{shown}:{port}"
        return sock

    def _serve(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, ready: dict,
               started: threading.Event) -> None:
        """The server thread: uvicorn's h11 protocol (ours, with limits) on this thread's event loop."""
        asyncio.set_event_loop(loop)
        try:
            app = ControlApp(self, self._pool)
            config = UvicornConfig(app, http="h11", ws="none", lifespan="off", interface="asgi3", log_config=None,
                                   proxy_headers=False, server_header=False, date_header=False,
                                   timeout_keep_alive=self.request_timeout,
                                   h11_max_incomplete_event_size=MAX_HEADER_BYTES)
            config.load()
            config.loaded_app = app  # no wrappers: uvicorn's trace-level message logger would log headers
            server_state = ServerState()
            server_state.default_headers = [(b"server", b"verl_ds-control")]
            limits = ConnectionLimits(request_timeout=self.request_timeout,
                                      max_open_connections=self.max_open_connections,
                                      linger_s=min(2.0, self.request_timeout))
            factory = functools.partial(ControlProtocol, config=config, server_state=server_state, app_state={},
                                        _loop=loop, limits=limits)
            server = loop.run_until_complete(loop.create_server(factory, sock=sock, backlog=self.backlog))
        except BaseException as e:  # noqa: BLE001 - reported by start()
            ready["error"] = e
            started.set()
            loop.close()
            return
        started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for conn in list(server_state.connections):
                conn.shutdown()
            for task in list(server_state.tasks):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0.05))  # let the cancelled requests and closed sockets finish
            loop.close()

    def stop(self) -> None:
        """Stop serving, close the socket and every connection, remove the URL file. Idempotent; never waits
        for a slow client or a stuck view, and never raises (it runs on every exit path of the trainer)."""
        with self._lock:
            loop, self._loop = self._loop, None
            thread, self._thread = self._thread, None
            if loop is None:
                return
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # already closed
                pass
            if thread is not None:
                thread.join(timeout=10.0)
            if self._pool is not None:
                self._pool.shutdown()
            self._remove_url_file()
            log.removeFilter(self._filter)

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

    def _remove_url_file(self) -> None:
        if self.run_dir is None:
            return
        path = os.path.join(self.run_dir, URL_FILE)
        try:
            with open(path, encoding="utf-8") as fh:
                ours = fh.read().strip() == self.url  # another server may have taken the run dir since
            if ours:
                os.unlink(path)
        except OSError:
            pass

    # ---- auth and token hygiene ------------------------------------------------------------------------
    def check_auth(self, headers: list[str]) -> None:
        """HTTPError 403 (mutations off) or 401 unless ``headers`` (Authorization values) carry the token; no echo."""
        if self.read_only:
            raise HTTPError(403, "this server is read-only (started with read_only=True); mutating routes are off")
        if self._token is None:
            raise HTTPError(403, _ENABLE_HINT)
        challenge = {"WWW-Authenticate": 'Bearer realm="verl_ds"'}
        if not headers:
            raise HTTPError(401, "missing 'Authorization: Bearer <token>' header", challenge)
        if len(headers) > 1:
            raise HTTPError(401, f"{len(headers)} Authorization headers; send exactly one", challenge)
        scheme, _, given = headers[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise HTTPError(401, "Authorization header must be 'Bearer <token>'", challenge)
        # header values arrive as latin-1 text; compare the exact bytes, in constant time
        if not hmac.compare_digest(given.strip().encode("latin-1", "replace"), self._token.encode("utf-8")):
            raise HTTPError(401, "invalid token", challenge)

    @staticmethod
    def _forms(token: str | None) -> list[str]:
        """The ways the token can appear in an answer or a log line: as is, JSON-escaped, repr-escaped."""
        if not token:
            return []
        forms = {token, json.dumps(token)[1:-1], repr(token)[1:-1], json.dumps(repr(token)[1:-1])[1:-1],
                 token.encode("utf-8").decode("latin-1")}
        return sorted(forms, key=len, reverse=True)

    def redact(self, text: str) -> str:
        """``text`` with every occurrence of the token replaced by '<redacted>'."""
        for form in self._token_forms:
            if form in text:
                text = text.replace(form, _REDACTED)
        return text

    def redact_bytes(self, data: bytes) -> bytes:
        if not self._token_forms:
            return data
        return self.redact(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
