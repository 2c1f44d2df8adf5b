"""Helpers and fixtures for tests of the process supervisor with real engine emulators
(here and in tests/capacity/actuation/test_process_actuator.py)."""

import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dataplane.supervisor.server import make_server
from dataplane.supervisor.supervisor import ProcessSupervisor
from tests.support.processes import free_ports

ROOT = Path(__file__).resolve().parents[3]

TINY_MODEL = {
    "name": "tiny",
    "replicas": 1,
    "max_num_seqs": 8,
    "kv_cache_tokens": 8192,
    "context_length": 4096,
    "prefill_seconds_per_token": 1e-5,
    "decode_step_base_seconds": 0.002,
    "decode_seconds_per_sequence": 1e-5,
    "decode_seconds_per_context_token": 1e-8,
    "mean_output_tokens": 8,
    "vocab_size": 1000,
}

SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)", "--port", "{port}")

OTHER_ENGINES = {
    "sleeper": SLEEPER,
    "sleeper-v2": (*SLEEPER, "--v2"),
    "missing": ("/nonexistent/engine", "--port", "{port}"),
}


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports."""
    return free_ports(count)


def wait_until(predicate, *, timeout_seconds: float = 15.0, what: str = "condition", detail=None):
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            found = f"; found {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}{found}")
        time.sleep(0.05)


def process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        # The process can exit between opening its stat file and reading it (ESRCH).
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no longer runs


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def replicas_of(supervisor: ProcessSupervisor, name: str) -> list[dict]:
    status = supervisor.deployment_status(name)
    return status["replicas"] if status else []


def ready_count(supervisor: ProcessSupervisor, name: str) -> int:
    status = supervisor.deployment_status(name)
    return status["ready"] if status else 0


class StreamedRequest(threading.Thread):
    """One long streamed completion against one replica, counting the tokens it receives."""

    def __init__(self, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.port = port
        self.max_tokens = max_tokens
        self.tokens = 0
        self.finish_reason = None
        self.done = False
        self.error = None
        self.first_token = threading.Event()

    def run(self):
        body = {
            "model": "tiny",
            "prompt": "drain me",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        try:
            with httpx.stream("POST", url, json=body, timeout=30) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        self.tokens += 1
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
                        self.first_token.set()
        except httpx.HTTPError as error:
            self.error = error
        finally:
            self.first_token.set()


@pytest.fixture
def emulator_command(tmp_path, monkeypatch):
    # The replicas are children of this process: they find `benchmarking` wherever we run.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config_path = tmp_path / "emulator.json"
    config_path.write_text(json.dumps({"models": [TINY_MODEL]}))
    return (
        sys.executable,
        "-m",
        "dataplane.emulator",
        "--port",
        "{port}",
        "--config",
        str(config_path),
    )


@pytest.fixture
def engines(emulator_command) -> dict:
    return {
        "emulator": emulator_command,
        # As a production fleet runs vLLM: admission's priorities need the priority policy.
        "emulator-priority": (*emulator_command, "--scheduling-policy", "priority"),
    } | OTHER_ENGINES


@pytest.fixture
def supervisor(tmp_path, engines):
    supervisor = ProcessSupervisor(
        engines=engines,
        log_dir=tmp_path / "logs",
        monitor_interval_seconds=0.05,
        restart_backoff_seconds=0.2,
        term_grace_seconds=3.0,
        drain_poll_seconds=0.05,
    ).start()
    yield supervisor
    supervisor.shutdown(drain=False)


# The control plane's name for the supervisor's token (tests set it to "s3cret-token").
SUPERVISOR_TOKEN_ENV = "MU_ACTUATOR_SUPERVISOR_TOKEN"


@pytest.fixture
def http_supervisor(supervisor, settings, monkeypatch):
    """The supervisor's API, its token bound to it as an operator binds it
    (ACTUATOR_SECRET_DESTINATIONS): in this process's settings and in the environment of the
    workers a test starts."""
    server = make_server(supervisor, port=0, token="s3cret-token")
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    bindings = {SUPERVISOR_TOKEN_ENV: {"supervisor": [server.url]}}
    settings.ACTUATOR_SECRET_DESTINATIONS = bindings
    monkeypatch.setenv("ACTUATOR_SECRET_DESTINATIONS", json.dumps(bindings))
    yield server
    server.shutdown()
    server.server_close()
