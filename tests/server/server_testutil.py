"""Helpers for the control-server tests: a real reward swapper, real HTTP clients (http.client and raw
sockets that always read an answer to its end), a small registry, a tiny reward-model checkpoint."""
from __future__ import annotations

import http.client
import json
import os
import selectors
import shutil
import socket
import threading
from urllib.parse import urlsplit

import torch.nn as nn

from verl_ds.registry import ModelRegistry
from verl_ds.reward_spec import parse_reward_swap
from verl_ds.state import STATE_KEYS, SharedState

TOKEN = "s3cret-token"


def default(key: str):
    """A SharedState key's default (the state module owns the defaults; these tests check the server)."""
    return STATE_KEYS[key].default


def range_text(key: str) -> str:
    return STATE_KEYS[key].schema()["range_text"]


class RecordingRewardSwapper:
    """A small real reward swapper that does what the trainer does: re-checks the (already validated)
    request with ``reward_spec.parse_reward_swap`` (no user code runs) and records what it staged."""

    def __init__(self, state: SharedState):
        self.state = state
        self.staged: list[dict] = []

    def stage_reward_swap(self, spec: dict, client: str = "") -> dict:
        request = parse_reward_swap(spec)
        self.staged.append({**request, "client": client})
        return {"staged": request, "applies_at_step": self.state.get("global_step") + 1}


class Answer:
    """Status, headers and body of one HTTP answer (``json`` decoded when the body is JSON)."""

    def __init__(self, status: int, headers: dict, raw: bytes):
        self.status, self.headers, self.raw = status, headers, raw
        self.text = raw.decode("utf-8")
        is_json = headers.get("content-type", "").startswith("application/json") and raw
        self.json = json.loads(self.text) if is_json else None

    @classmethod
    def of(cls, resp: http.client.HTTPResponse) -> "Answer":
        return cls(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())

    def __repr__(self):
        return f"Answer({self.status}, {self.text[:300]!r})"


def call(url: str, method: str, path: str, body=None, token: str | None = None, headers: dict | None = None,
         raw: bytes | None = None, timeout: float = 10.0) -> Answer:
    """One request on a fresh connection; ``body`` is sent as JSON, ``raw`` as given."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=data, headers=hdrs)
        return Answer.of(conn.getresponse())
    finally:
        conn.close()


# ---- raw sockets: every read goes to the end of an answer (Content-Length, chunked, or close) --------------
class RawReader:
    """Reads HTTP answers from a socket, keeping what it read past the current one."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _more(self, what: str) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed while reading {what}; got {self.buf[:200]!r}")
        self.buf += chunk

    def head(self) -> tuple[int, dict]:
        """The next status line and headers (a ``100 Continue`` counts as one answer)."""
        while b"\r\n\r\n" not in self.buf:
            self._more("an answer's head")
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        return int(lines[0].split(" ", 2)[1]), headers

    def answer(self, to_head: bool = False) -> Answer:
        """The next final answer, body read to its end (``to_head``: the answer to a HEAD request has none)."""
        status, headers = self.head()
        while 100 <= status < 200:
            status, headers = self.head()
        if to_head:
            body = b""
        elif "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                self._more(f"a {n}-byte body")
            body, self.buf = self.buf[:n], self.buf[n:]
        elif "chunked" in headers.get("transfer-encoding", ""):
            body = b""
            while True:
                while b"\r\n" not in self.buf:
                    self._more("a chunk size")
                size_line, _, self.buf = self.buf.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                while len(self.buf) < size + 2:
                    self._more("a chunk")
                body, self.buf = body + self.buf[:size], self.buf[size + 2:]
                if size == 0:
                    break
        else:
            body = self.rest()
        return Answer(status, headers, body)

    def rest(self) -> bytes:
        """Everything until the server closes the connection."""
        while chunk := self.sock.recv(65536):
            self.buf += chunk
        out, self.buf = self.buf, b""
        return out


def raw_exchange(port: int, data: bytes, timeout: float = 30.0) -> Answer:
    """Send raw bytes, half-close, and read the answer to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return RawReader(s).answer()


def dropped(sock: socket.socket) -> bool:
    """True when the server closed ``sock`` without sending a byte (EOF or reset), read to the end; waits up
    to the socket timeout for the close."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received == b""


def connect(port: int) -> socket.socket:
    """A client socket to the server on 127.0.0.1."""
    return socket.create_connection(("127.0.0.1", port), timeout=30)


class IdleFlood:
    """Keeps ``n`` idle connections open, reopening each one the server closes (a client that reconnects at
    once), until stopped; bounded by ``max_reopen`` reconnections."""

    def __init__(self, port: int, n: int, max_reopen: int = 5000):
        self.port, self.max_reopen = port, max_reopen
        self.first = [connect(port) for _ in range(n)]
        self.socks = list(self.first)
        self.reopened, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with selectors.DefaultSelector() as sel:  # not select(): file descriptors go past 1024 here
            for s in self.socks:
                sel.register(s, selectors.EVENT_READ)
            while not self.stop.is_set() and self.reopened < self.max_reopen:
                for key, _ in sel.select(0.05):  # closed by the server (EOF or reset): reconnect at once
                    s = key.fileobj
                    sel.unregister(s)
                    self.socks.remove(s)
                    if s not in self.first:
                        s.close()
                    try:
                        new = connect(self.port)
                    except OSError:
                        continue
                    self.socks.append(new)
                    sel.register(new, selectors.EVENT_READ)
                    self.reopened += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)
        for s in set(self.socks) | set(self.first):
            s.close()


# ---- models --------------------------------------------------------------------------------------------------
class Box:
    """A registry entry that is not a torch module (like a function reward)."""


def make_registry() -> ModelRegistry:
    reg = ModelRegistry()
    reg.register("actor", nn.Linear(4, 3), aliases=("ppo_actor", "policy"))  # 15 parameters
    frozen = nn.Linear(2, 2)
    for p in frozen.parameters():
        p.requires_grad_(False)
    reg.register("ref", frozen, aliases=("reference",))
    reg.register("reward", Box(), aliases=("reward_model",))
    return reg


def save_tiny_reward_model(path: str, vocab_size: int = 64) -> str:
    """A real 1-label LlamaForSequenceClassification checkpoint (save_pretrained) in ``path``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    return path


def variant(src: str, dst: str, *, drop: tuple = (), weights: bool = True, **config_changes) -> str:
    """A copy of checkpoint ``src`` in ``dst`` with config.json keys changed (None deletes) or dropped."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    for k in drop:
        config.pop(k, None)
    config.update(config_changes)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    if weights:
        shutil.copy(os.path.join(src, "model.safetensors"), dst)
    return dst
