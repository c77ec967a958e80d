"""The routes of the control server (reference: docs/http_api.md). Each view runs in a worker thread and returns
``(status, payload)``: a dict is sent as JSON, a str as Prometheus text; errors are raised as ``HTTPError``.
Answers decided before authentication (404, 405, every GET) never repeat what the client sent, not even redacted:
an echo with the token replaced by '<redacted>' would tell a client which of many guesses was the token."""
from __future__ import annotations

import difflib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple
from urllib.parse import unquote

from verl_ds.reward_spec import check_reward_spec
from verl_ds.rewards import REWARD_FNS
from verl_ds.server.jsonio import HTTPError
from verl_ds.server.prometheus import prometheus_text
from verl_ds.state import STATE_KEYS, StateValidationError, UnknownStateKeyError

__all__ = ["Handler", "ROUTES", "Route", "resolve", "ROUTE_LIST", "shown_method"]

log = logging.getLogger("verl_ds.server")

# registry names/classes -> the role shown in /v1/models (a model's own ``role`` attribute wins)
_ROLE_NAMES = ("actor", "critic", "ref", "reward")
_ROLE_CLASSES = {"PolicyModel": "actor", "ValueModel": "critic", "RewardModel": "reward", "PPOModel": "algorithm"}
ROUTE_LIST = ("GET /healthz, GET /metrics, GET /v1/models, GET /v1/models/{id}, POST /v1/models/reward, "
              "GET|PATCH /v1/state, GET /v1/state/{key}")

Server = Any  # the ControlServer a view serves (verl_ds.server.control imports this module, never the reverse)
View = Callable[[Server, str, "dict | None", str], "tuple[int, Any]"]
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})


def shown_method(method: str) -> str:
    """The method as an answer may name it: a standard one by name, any other (maybe the token) not at all."""
    return f"method {method}" if method in _METHODS else "this method"


@dataclass(frozen=True)
class Handler:
    """One method of a route. ``mutating``: needs the bearer token and a JSON object body."""
    fn: View
    mutating: bool = False


# ---- views ------------------------------------------------------------------------------------------------
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


def _model_entry(srv: Server, info: dict) -> dict:
    """One /v1/models entry: the OpenAI fields plus verl_ds's."""
    model = srv.registry.get(info["name"], None)
    return {"id": info["name"], "object": "model", "created": int(info["registered_at"]), "owned_by": "verl_ds",
            "role": _role_of(info["name"], info["aliases"], model), "aliases": info["aliases"],
            "class": info["class"], "version": info["version"], "trainable": info["trainable"],
            "num_parameters": info["num_parameters"]}


def health(srv: Server, arg: str, body: None, client: str) -> tuple[int, dict]:
    return 200, {"status": "ok", "global_step": srv.state.get("global_step"), "state_version": srv.state.version,
                 "uptime_s": round(time.time() - (srv.started_at or time.time()), 3),
                 "mutations": "enabled" if srv.mutations_enabled else "disabled"}


def metrics(srv: Server, arg: str, body: None, client: str) -> tuple[int, str]:
    return 200, prometheus_text(dict(srv.metrics_fn() or {}), srv.state.snapshot(), srv.state.version)


def models(srv: Server, arg: str, body: None, client: str) -> tuple[int, dict]:
    state = srv.state.snapshot()
    return 200, {"object": "list", "data": [_model_entry(srv, i) for i in srv.registry.snapshot()],
                 "state": state, "state_version": srv.state.version, "global_step": state["global_step"]}


def model(srv: Server, model_id: str, body: None, client: str) -> tuple[int, dict]:
    snapshot = srv.registry.snapshot()
    for info in snapshot:
        if model_id == info["name"] or model_id in info["aliases"]:
            return 200, _model_entry(srv, info)
    pool = sorted({i["name"] for i in snapshot} | {a for i in snapshot for a in i["aliases"]})
    close = difflib.get_close_matches(model_id, pool, n=3, cutoff=0.5)
    # 'reward_model_v2' vs 'reward': a shared prefix counts too (as in ModelRegistry's message)
    close += [p for p in pool if p not in close and min(len(p), len(model_id)) >= 3
              and (p.startswith(model_id) or model_id.startswith(p))]
    close = close[:3]
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    # the id is not repeated back (module docstring); suggestions come from the registered names only
    raise HTTPError(404, f"no model is registered under the requested id{hint}", suggestions=close,
                    models=[i["name"] for i in snapshot], aliases=srv.registry.aliases())


def state(srv: Server, arg: str, body: None, client: str) -> tuple[int, dict]:
    values = srv.state.snapshot()
    return 200, {"values": values, "schema": srv.state.schema(), "version": srv.state.version,
                 "global_step": values["global_step"], "pending": srv.state.staged()}


def state_key(srv: Server, key: str, body: None, client: str) -> tuple[int, dict]:
    try:
        value = srv.state.get(key)
    except UnknownStateKeyError:
        close = difflib.get_close_matches(key, list(STATE_KEYS), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise HTTPError(404, f"unknown SharedState key{hint} (valid keys: {sorted(STATE_KEYS)})",
                        suggestions=close) from None
    return 200, {"key": key, "value": value, "schema": STATE_KEYS[key].schema(), "version": srv.state.version}


def patch_state(srv: Server, arg: str, body: dict, client: str) -> tuple[int, dict]:
    if not body:
        raise HTTPError(400, "empty update: send a JSON object of {key: value} with at least one key; "
                             "GET /v1/state lists the hot-updatable keys")
    try:
        result = srv.state.stage(body, client=client)
    except StateValidationError as e:
        raise HTTPError(400, str(e), errors=e.errors) from None
    log.info("control server: %s staged %s for step %s", client, result["staged"], result["applies_at_step"])
    return 202, {**result, "status": "staged"}


def swap_reward(srv: Server, arg: str, body: dict, client: str) -> tuple[int, dict]:
    """Validate with ``reward_spec.check_reward_spec`` (no user code runs here), then stage through the swapper."""
    if srv.reward_swapper is None:
        raise HTTPError(501, "reward swapping is not available: this server has no reward_swapper "
                             "(the trainer provides one)")
    try:
        spec = check_reward_spec(body, allow_code=srv.allow_reward_code, swappable=srv.swappable_rewards,
                                 reward_model_dir=srv.reward_model_dir, vocab_size=srv.policy_vocab_size)
    except (ValueError, TypeError) as e:
        raise HTTPError(400, str(e)) from None
    code = [f["name"] for f in spec["functions"] if f["name"] not in REWARD_FNS and f["name"] not in srv.swappable_rewards]
    if code:
        log.warning("control server: !!! %s is swapping in reward CODE that the config did not declare: %s; it will "
                    "be imported and run on every rank at the next step (server.allow_reward_code=true) !!!",
                    client, code)
    try:
        result = srv.reward_swapper.stage_reward_swap(spec, client=client)
    except (ValueError, TypeError) as e:
        raise HTTPError(400, str(e)) from None
    log.info("control server: %s staged a reward swap %s", client, result)
    return 202, {**result, "status": "staged"}


# ---- the route table --------------------------------------------------------------------------------------
def _read(fn: View) -> dict[str, Handler]:
    return {"GET": Handler(fn), "HEAD": Handler(fn)}


# (exact path or prefix ending in '/', handlers); the first match wins, so /v1/models/reward comes before
# /v1/models/{id}. A prefix entry passes the rest of the path (percent-decoded) to its views.
ROUTES: list[tuple[str, dict[str, Handler]]] = [
    ("/healthz", _read(health)),
    ("/metrics", _read(metrics)),
    ("/v1/models", _read(models)),
    ("/v1/models/reward", {**_read(model), "POST": Handler(swap_reward, mutating=True)}),
    ("/v1/models/", _read(model)),
    ("/v1/state", {**_read(state), "PATCH": Handler(patch_state, mutating=True)}),
    ("/v1/state/", _read(state_key)),
]
_ARG_NAMES = {"/v1/models/": "{id}", "/v1/state/": "{key}"}  # how a prefix route is named in an answer


class Route(NamedTuple):
    """A resolved path: its handlers by method, the argument of a prefix route, and its name as answers show it
    ('/v1/state/{key}', never the path the client sent)."""
    handlers: dict[str, Handler]
    arg: str
    name: str


def resolve(path: str) -> Route | None:
    """The Route of a raw (percent-encoded) path without its query, trailing slash ignored; None if none matches."""
    if len(path) > 1:
        path = path.rstrip("/") or "/"
    for pattern, handlers in ROUTES:
        if pattern.endswith("/"):
            if path.startswith(pattern) and len(path) > len(pattern):
                return Route(handlers, unquote(path[len(pattern):]), pattern + _ARG_NAMES[pattern])
        elif path == pattern:
            return Route(handlers, pattern.rpartition("/")[2], pattern)
    return None
