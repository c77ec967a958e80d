"""The runtime control plane: a small JSON-over-HTTP server on rank 0, served by uvicorn (h11); routes, auth and limits
in docs/http_api.md. Modules, each importing only those after it: ``control``, ``app``, ``views``, ``protocol``,
``jsonio``, ``prometheus``."""
from verl_ds.server.control import TOKEN_ENV, URL_FILE, ControlServer, is_loopback
from verl_ds.server.prometheus import prometheus_text

__all__ = ["ControlServer", "TOKEN_ENV", "URL_FILE", "prometheus_text", "is_loopback"]
