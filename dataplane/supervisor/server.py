"""`python -m dataplane.supervisor`: own the engine processes of this GPU host.

The process actuator (`capacity/actuation/process.py`) calls this over HTTP; see
`dataplane/supervisor/supervisor.py` for what the supervisor does with the processes. Plain
Python: its configuration is its command line and the environment, never Django's settings.

    POST /scale   {"deployment", "replicas", "engine", "host", "base_port", "drain_seconds"}
                  → 200 with the deployment's status; 400 for a bad request, an engine not
                  on the allow-list, a `command`, or a port clash
    POST /restart {"deployment", "replica"} → the replica's status
    GET  /status  → {"deployments": {name: status}} (each with its engine's name)
    GET  /health  → 200, without a token (for a service manager's liveness check)

The commands are the operator's: only the engines given at start run, each an argv template
with "{port}" (and optionally "{replica}", "{host}"):

    python -m dataplane.supervisor \
        --engine llama-8b='vllm serve meta-llama/Llama-3.1-8B-Instruct --port {port}' \
        --engines /etc/mu/engines.json          # {"name": ["argv", "…", "{port}"]}

Whoever can call `/scale` still chooses how many of them run and on which ports, so when the
environment variable PROCESS_SUPERVISOR_TOKEN is set every call needs `Authorization: Bearer
<token>`, and listening beyond the loopback interface without one is refused.

The first Ctrl-C or SIGTERM stops taking calls and drains every replica; a second one cuts
the drains short (SIGTERM now, SIGKILL after the grace).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, cast

from .supervisor import (
    ProcessSupervisor,
    SpecError,
    SupervisorClosed,
    parse_engines,
    parse_scale_request,
)

logger = logging.getLogger(__name__)

TOKEN_ENV = "PROCESS_SUPERVISOR_TOKEN"
DEFAULT_PORT = 8190
MAX_BODY_BYTES = 64 * 1024


class SupervisorHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], supervisor: ProcessSupervisor, token: str):
        self.supervisor = supervisor
        self.token = token
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        # Bound to an IPv4/IPv6 (host, port) address: the first two items are the str and int.
        host, port = cast(tuple[str, int], self.server_address[:2])
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: SupervisorHTTPServer
    server_version = "process-supervisor"

    def do_GET(self) -> None:
        self._answer(self._get)

    def do_POST(self) -> None:
        self._answer(self._post)

    def _answer(self, handle: Callable[[], None]) -> None:
        try:
            handle()
        except Exception:  # a 500 the actuator retries, not a dropped connection
            logger.exception("process supervisor: %s %s failed", self.command, self.path)
            self._json(500, {"error": "internal error; see the supervisor's log."})

    def _get(self) -> None:
        if self.path == "/health":
            self._json(200, {"ok": True})
        elif not self._authorised():
            return
        elif self.path == "/status":
            self._json(200, self.server.supervisor.status())
        else:
            self._json(404, {"error": f"no such endpoint: GET {self.path}"})

    def _post(self) -> None:
        if not self._authorised():
            return
        if self.path not in ("/scale", "/restart"):
            self._json(404, {"error": f"no such endpoint: POST {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._json(400, {"error": "Content-Length must be an integer."})
            return
        if length > MAX_BODY_BYTES:
            self._json(413, {"error": f"the body must be at most {MAX_BODY_BYTES} bytes."})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            self._json(400, {"error": f"the body is not valid JSON: {error}."})
            return
        if self.path == "/restart":
            self._restart(body)
            return
        try:
            name, replicas, spec = parse_scale_request(body)
            status = self.server.supervisor.scale(name, replicas, spec)
        except SpecError as error:
            self._json(400, {"error": str(error)})
            return
        except SupervisorClosed as error:
            self._json(503, {"error": str(error)})
            return
        self._json(200, status)

    def _restart(self, body: object) -> None:
        """POST /restart {"deployment": name, "replica": index}: the health probes' restart."""
        if not isinstance(body, dict):
            self._json(400, {"error": "the body must be a JSON object."})
            return
        name, index = body.get("deployment"), body.get("replica")
        if not isinstance(name, str) or not name:
            self._json(400, {"error": "deployment: must be a deployment name."})
            return
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            self._json(400, {"error": "replica: must be a replica index (an integer ≥ 0)."})
            return
        try:
            status = self.server.supervisor.restart(name, index)
        except LookupError as error:
            self._json(404, {"error": str(error)})
            return
        except SupervisorClosed as error:
            self._json(503, {"error": str(error)})
            return
        self._json(200, status)

    def _authorised(self) -> bool:
        token = self.server.token
        if not token:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
        self._json(401, {"error": "a valid 'Authorization: Bearer <token>' header is required."})
        return False

    def _json(self, status: int, payload: Mapping[str, object]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


def make_server(
    supervisor: ProcessSupervisor,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str = "",
) -> SupervisorHTTPServer:
    """The HTTP API over `supervisor`, bound (port 0: any free port) but not yet serving."""
    return SupervisorHTTPServer((host, port), supervisor, token)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CommandError(Exception):
    """The supervisor cannot start as asked (printed as `error: ...`, exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dataplane.supervisor",
        description="Run and supervise engine processes on this host for the `process` actuator.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address of the HTTP API.")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=ARGV",
        help="An engine this supervisor may run: NAME='argv with {port}' (shell-quoted; "
        "repeatable).",
    )
    parser.add_argument(
        "--engines",
        default=None,
        metavar="FILE",
        help='A JSON file of engines: {"NAME": ["argv", "...", "{port}"]}.',
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="Write each replica's output to LOG_DIR/<deployment>-<i>.log (default: ours).",
    )
    return parser


def _say(line: str) -> None:
    print(line, flush=True)  # whoever started us may be waiting for it on a pipe


def run(argv: list[str] | None = None) -> None:
    """Parse `argv`, start the supervisor and its API, serve until SIGINT/SIGTERM.

    Raises `CommandError` when it cannot start as asked."""
    options = build_parser().parse_args(argv)
    host = options.host
    token = os.environ.get(TOKEN_ENV, "")
    if not token and not _is_loopback(host):
        raise CommandError(
            f"Refusing to listen on {host} without a token: anyone reaching the API could "
            f"run commands on this host. Set {TOKEN_ENV}, or listen on 127.0.0.1."
        )
    try:
        engines = parse_engines(options.engine, options.engines)
    except ValueError as error:
        raise CommandError(str(error)) from error
    if not engines:
        raise CommandError(
            "No engine to run: give at least one with --engine NAME='argv with {port}' "
            "or --engines FILE."
        )
    supervisor = ProcessSupervisor(engines=engines, log_dir=options.log_dir).start()
    try:
        server = make_server(supervisor, host=host, port=options.port, token=token)
    except OSError as error:
        supervisor.shutdown(drain=False)
        raise CommandError(f"Cannot listen on {host}:{options.port}: {error}") from error
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop_requested.is_set():
            supervisor.hurry()
        stop_requested.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    serving = threading.Thread(target=server.serve_forever, name="supervisor-http")
    serving.start()
    _say(
        f"Process supervisor listening on {server.url}"
        f"{' (token required)' if token else ''}, engines: {', '.join(sorted(engines))} "
        "(Ctrl-C to stop)"
    )
    # Waited in slices: the signal handlers run on this thread between them.
    while not stop_requested.wait(0.5):
        pass
    _say("Stopping: draining replicas (Ctrl-C again to cut drains short)")
    server.shutdown()
    serving.join()
    server.server_close()
    supervisor.shutdown(drain=True)
    _say("Process supervisor stopped.")


def _configure_logging() -> None:
    """As the control plane logs (LOG_LEVEL, default INFO; httpx quiet), without Django."""
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise CommandError(f"LOG_LEVEL: not a logging level: {level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    try:
        _configure_logging()
        run(argv)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
