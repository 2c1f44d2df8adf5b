"""The control plane served by gunicorn in a subprocess, on the test database, for tests
that need real concurrent clients over HTTP."""

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.benchmarking.processes import free_port, test_database_url

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def gunicorn_server(tmp_path: Path, *, workers: int = 4, threads: int = 4):
    port = free_port()
    log_path = tmp_path / f"gunicorn-{port}.log"
    env = os.environ | {"DATABASE_URL": test_database_url(), "SECURE_SSL_REDIRECT": "0"}
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
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not start: " + log_path.read_text()[-2000:])
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
