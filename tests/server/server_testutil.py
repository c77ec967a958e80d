"""Helpers for the control-server tests: a real reward swapper, a real HTTP client, a small registry."""
from __future__ import annotations

import http.client
import json
import os
from urllib.parse import urlsplit

import torch.nn as nn

from verl_ds.registry import ModelRegistry
from verl_ds.rewards import resolve_reward_fn
from verl_ds.state import SharedState

TOKEN = "s3cret-token"


class RecordingRewardSwapper:
    """A small real reward swapper: validates like the trainer (shipped names / 'module:fn' through
    resolve_reward_fn, local directories for model_path) and records what it staged."""

    def __init__(self, state: SharedState):
        self.state = state
        self.staged: list[dict] = []

    def stage_reward_swap(self, spec: dict, client: str) -> dict:
        unknown = set(spec) - {"function", "functions", "model_path"}
        if unknown:
            raise ValueError(f"reward swap: unknown field(s) {sorted(unknown)}; expected function, functions, model_path")
        functions = list(spec.get("functions") or []) + ([{"name": spec["function"]}] if "function" in spec else [])
        if not functions and "model_path" not in spec:
            raise ValueError("reward swap: give 'function', 'functions' or 'model_path'")
        for i, f in enumerate(functions):
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError(f"reward swap: functions[{i}]: expected {{name, weight}}, got {f!r}")
            resolve_reward_fn(f["name"])
        if "model_path" in spec and not os.path.isdir(str(spec["model_path"])):
            raise ValueError(f"reward swap: model_path {spec['model_path']!r} is not a local directory")
        request = {"functions": functions, "model_path": spec.get("model_path")}
        self.staged.append({**request, "client": client})
        return {"staged": request, "applies_at_step": self.state.get("global_step") + 1}


class Answer:
    """Status, headers and body of one HTTP answer (``json`` decoded when the body is JSON)."""

    def __init__(self, resp: http.client.HTTPResponse):
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders()}
        self.raw = resp.read()
        self.text = self.raw.decode("utf-8")
        is_json = self.headers.get("content-type", "").startswith("application/json") and self.raw
        self.json = json.loads(self.text) if is_json else None

    def __repr__(self):
        return f"Answer({self.status}, {self.text[:300]!r})"


def call(url: str, method: str, path: str, body=None, token: str | None = None, headers: dict | None = None,
         raw: bytes | None = None) -> Answer:
    """One request on a fresh connection; ``body`` is sent as JSON, ``raw`` as given."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        hdrs = dict(headers or {})
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=data, headers=hdrs)
        return Answer(conn.getresponse())
    finally:
        conn.close()


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
