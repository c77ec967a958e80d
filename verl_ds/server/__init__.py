"""The runtime control plane: a small JSON-over-HTTP server on rank 0, served by uvicorn (h11).

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
configured they answer 403 and say how to enable them, and binding a non-loopback address with mutations
enabled and no token is refused. The token never appears in an answer or a log line. Bodies are capped
whatever their framing, a request's head and its body each have a deadline, requests in progress and open
connections are capped (503), a reward swap runs no user code in the server, and any handler exception is
answered with a JSON 500 and logged: the server thread never takes the training loop down with it.

Modules: ``control`` (ControlServer: options, lifecycle, auth), ``views`` (the route table), ``app`` (the
ASGI app: limits, bodies, answers), ``protocol`` (connection deadlines and caps on uvicorn's h11 protocol),
``jsonio`` (strict JSON in, valid JSON out), ``prometheus`` (``GET /metrics``).
"""
from verl_ds.server.control import TOKEN_ENV, URL_FILE, ControlServer, is_loopback
from verl_ds.server.prometheus import prometheus_text

__all__ = ["ControlServer", "TOKEN_ENV", "URL_FILE", "prometheus_text", "is_loopback"]
