"""``verl-ds state get [KEY]`` / ``verl-ds state set KEY=VALUE ...``: read and change a running job's SharedState
through its control server (docs/http_api.md, "The verl-ds state command")."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from verl_ds.server import TOKEN_ENV, URL_FILE

__all__ = ["main", "build_parser", "resolve_url", "parse_assignments", "request", "ClientError"]

URL_ENV = "VERL_DS_SERVER_URL"
DEFAULT_RUN_DIR = os.path.join("runs", "default")


class ClientError(Exception):
    """A refused or failed request; ``exit_code`` is what ``main`` returns."""

    def __init__(self, message: str, exit_code: int = 1, status: int | None = None, body: dict | None = None):
        super().__init__(message)
        self.exit_code, self.status, self.body = exit_code, status, body


def resolve_url(url: str | None = None, run_dir: str | None = None) -> str:
    """The server URL from (in order) ``url``, ``<run_dir>/server_url.txt``, $VERL_DS_SERVER_URL,
    ``runs/default/server_url.txt``; ClientError (exit 2) when none gives one."""
    if url:
        return url.rstrip("/")
    if run_dir is None and os.environ.get(URL_ENV):
        return os.environ[URL_ENV].strip().rstrip("/")
    path = os.path.join(run_dir if run_dir is not None else DEFAULT_RUN_DIR, URL_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            found = fh.read().strip()
    except FileNotFoundError:
        found = ""
    if found:
        return found.rstrip("/")
    where = f"{path!r} does not exist or is empty (is the run started with server.enabled=true?)"
    raise ClientError(f"no server URL: {where}; pass --url http://HOST:PORT, --run-dir RUN_DIR or set {URL_ENV}",
                      exit_code=2)


def parse_assignments(pairs: list[str]) -> dict:
    """['kl_coef=0.05', 'kl_kind=k3'] -> {'kl_coef': 0.05, 'kl_kind': 'k3'} (JSON values, else strings)."""
    if not pairs:
        raise ClientError("set: give at least one KEY=VALUE, e.g. verl-ds state set kl_coef=0.05", exit_code=2)
    out: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ClientError(f"set: expected KEY=VALUE, got {pair!r}", exit_code=2)
        if key in out:
            raise ClientError(f"set: key {key!r} given twice", exit_code=2)
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def request(method: str, url: str, body: dict | None = None, token: str | None = None,
            timeout: float = 10.0) -> dict:
    """One JSON request; returns the decoded answer or raises ClientError with the server's message."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        raw = e.read().decode("utf-8", "replace")
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"error": raw.strip() or e.reason}
        message = answer.get("error", raw) if isinstance(answer, dict) else raw
        raise ClientError(f"{method} {url}: HTTP {e.code}: {message}", status=e.code,
                          body=answer if isinstance(answer, dict) else None) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ClientError(f"cannot reach the control server at {url}: {reason}") from None


def build_parser(prog: str = "verl-ds state") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Read or change the SharedState of a running verl_ds job.")
    p.add_argument("--url", default=None, help=f"server URL (default: --run-dir's {URL_FILE}, then ${URL_ENV})")
    p.add_argument("--run-dir", default=None, help=f"run directory holding {URL_FILE} (default {DEFAULT_RUN_DIR})")
    p.add_argument("--token", default=None, help=f"bearer token for 'set' (default ${TOKEN_ENV}, preferred: a "
                   "command-line token is visible to other users in ps)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    sub = p.add_subparsers(dest="action", required=True)
    g = sub.add_parser("get", help="print every value (and the version), or one KEY with its schema")
    g.add_argument("key", nargs="?", default=None)
    g.add_argument("--schema", action="store_true", help="include the schema of every key")
    s = sub.add_parser("set", help="stage KEY=VALUE updates; they apply at the next step boundary")
    s.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    return p


def run(args: argparse.Namespace) -> dict:
    """The JSON to print for parsed arguments (raises ClientError)."""
    url = resolve_url(args.url, args.run_dir)
    if args.action == "get":
        if args.key:
            return request("GET", f"{url}/v1/state/{urllib.request.quote(args.key, safe='')}", timeout=args.timeout)
        answer = request("GET", f"{url}/v1/state", timeout=args.timeout)
        if not args.schema:
            answer.pop("schema", None)
        return answer
    updates = parse_assignments(args.assignments)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    return request("PATCH", f"{url}/v1/state", updates, token=token, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-ds state ...`` (``argv`` excludes 'state'); prints JSON, returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage
        return int(e.code or 0)
    try:
        answer = run(args)
    except ClientError as e:
        print(f"verl-ds state: error: {e}", file=sys.stderr, flush=True)
        if e.body and e.body.get("errors"):
            print(json.dumps({"errors": e.body["errors"]}, indent=1), file=sys.stderr, flush=True)
        return e.exit_code
    print(json.dumps(answer, indent=1, sort_keys=True, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
