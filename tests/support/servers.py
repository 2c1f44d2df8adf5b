"""Servers for tests: the control plane served by gunicorn in a subprocess, on the test
database, for tests that need real concurrent clients over HTTP; a throwaway HTTP server for a
handler class (`serving`)."""

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.processes import free_port, test_database_url
from tests.support.subprocesses import stop, wait_until_answering

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def gunicorn_server(
    tmp_path: Path, *, workers: int = 4, threads: int = 4, env: dict[str, str] | None = None
):
    port = free_port()
    log_path = tmp_path / f"gunicorn-{port}.log"
    env = (
        os.environ
        | {
            "DATABASE_URL": test_database_url(),
            "SECURE_SSL_REDIRECT": "0",
            "DJANGO_SETTINGS_MODULE": "tests.support.server_settings",
        }
        | (env or {})
    )
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "gunicorn", "controlplane.wsgi:application",
                "--bind", f"127.0.0.1:{port}", "--workers", str(workers),
                "--threads", str(threads), "--backlog", "512", "--timeout", "120",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url + "/healthz", process, what="gunicorn", log_path=log_path)
        yield url
    finally:
        stop(process)


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A throwaway HTTP server on a free port answering with `handler`; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class BackgroundHTTPServer:
    """An HTTP server on a free port in a daemon thread, for the test doubles of other
    services (a recording server, a fake scale API, a webhook receiver)."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1"):
        self._httpd = ThreadingHTTPServer((host, 0), handler)
        self._httpd.daemon_threads = True
        self.base_url = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
