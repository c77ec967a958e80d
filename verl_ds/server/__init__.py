"""The runtime control plane: a small JSON-over-HTTP server on rank 0, served by uvicorn (h11); docs/http_api.md
has the routes, the authentication and the limits. Modules, each importing only those after it: ``control``
(ControlServer: options, lifecycle, auth), ``app`` (the ASGI app: limits, bodies, answers), ``views`` (the route
table), ``protocol`` (connection deadlines and caps on uvicorn's h11 protocol), ``jsonio``, ``prometheus``.
"""
from verl_ds.server.control import TOKEN_ENV, URL_FILE, ControlServer, is_loopback
from verl_ds.server.prometheus import prometheus_text

__all__ = ["ControlServer", "TOKEN_ENV", "URL_FILE", "prometheus_text", "is_loopback"]
