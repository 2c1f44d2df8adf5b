"""The real control plane beside the gateway's tests: gunicorn on the test database, and the
client requests the end-to-end tests send through the gateway."""

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

from tests.support import processes
from tests.support.processes import ROOT
from tests.support.subprocesses import stop, wait_until_answering

# Long enough to leave after the first token (2 ms a step), small enough to fit acme's bucket.
CANCELLED_MAX_TOKENS = 300


@contextmanager
def control_plane(tmp_path, port: int):
    """gunicorn serving the control plane on the test database, on a chosen port (so it can be
    stopped and started again where the gateway looks for it)."""
    log_path = tmp_path / f"gunicorn-{port}-{time.monotonic_ns()}.log"
    env = os.environ | {"DATABASE_URL": processes.test_database_url(), "SECURE_SSL_REDIRECT": "0"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "controlplane.wsgi:application",
             "--bind", f"127.0.0.1:{port}", "--workers", "2", "--timeout", "60"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url + "/healthz", process, what="gunicorn", log_path=log_path)
        yield url
    finally:
        stop(process)


def complete(client, gateway_url, key, model, *, stream: bool, max_tokens: int = 6):
    """One request; (request id, status, usage the client saw or None)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        response = client.post(gateway_url + "/v1/chat/completions", json=body, headers=headers)
        usage = response.json().get("usage") if response.status_code == 200 else None
        return response.headers.get("x-request-id"), response.status_code, usage
    usage = None
    with client.stream(
        "POST", gateway_url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return response.headers.get("x-request-id"), response.status_code, usage


def cancel_mid_stream(gateway_url, key, model, max_tokens: int = CANCELLED_MAX_TOKENS):
    """A client that leaves after the first token of a long answer; its request id."""
    # ignore_eos (vLLM's sampling parameter, passed through): the answer is long for sure.
    body = {"model": model, "messages": [{"role": "user", "content": "a long one"}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=30, trust_env=False) as client, client.stream(
        "POST", gateway_url + "/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return response.headers.get("x-request-id")
    raise AssertionError("no token before leaving")
