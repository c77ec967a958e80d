"""The runtime control plane: a small JSON-over-HTTP server on rank 0, served by uvicorn (h11); the routes are in
``views`` and docs/http_api.md (with curl examples).

Mutating routes need ``Authorization: Bearer <token>`` (without one they answer 403; a non-loopback bind without
one is refused); the token never appears in an answer or a log line. Bodies, heads, requests in progress and open
connections are bounded, a reward swap runs no user code in the server, and a handler's exception is a JSON 500:
the server thread never takes the training loop down. Modules, each importing only those after it: ``control``
(ControlServer: options, lifecycle, auth), ``app`` (the ASGI app: limits, bodies, answers), ``views`` (the route
table), ``protocol`` (connection deadlines and caps on uvicorn's h11 protocol), ``jsonio``, ``prometheus``.
"""
from verl_ds.server.control import TOKEN_ENV, URL_FILE, ControlServer, is_loopback
from verl_ds.server.prometheus import prometheus_text

__all__ = ["ControlServer", "TOKEN_ENV", "URL_FILE", "prometheus_text", "is_loopback"]
