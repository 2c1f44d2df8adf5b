"""Real processes for the gateway's tests: Redis (the tests' own database), emulator
subprocesses as replicas, the gateway as a subprocess, a recording server for usage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from capacity.admission.redis_buckets import Buckets
from tests.support.admission import set_rates
from tests.support.processes import ROOT, emulator_subprocess, free_port
from tests.support.recording_server import RecordingServer
from tests.support.subprocesses import stop, wait_until_answering

from . import contract as C

SERVICE_KEY = "mu000000000000.test-service-key-for-usage"
USAGE_OK = json.dumps({"accepted": [], "duplicates": [], "rejected": []}).encode()


def tiny_model(**overrides) -> dict:
    """The emulator's fast model: 2 ms decode steps, short outputs."""
    spec = {
        "name": "tiny",
        "replicas": 1,
        "cold_start_seconds": 0,
        "max_num_seqs": 64,
        "kv_cache_tokens": 65536,
        "context_length": 2048,
        "prefill_seconds_per_token": 0.0,
        "decode_step_base_seconds": 0.002,
        "decode_seconds_per_sequence": 0.0,
        "decode_seconds_per_context_token": 0.0,
        "mean_output_tokens": 16,
        "vocab_size": 32000,
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def rds() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    C.clear(client)
    yield client
    C.clear(client)
    client.close()


def set_limits(client: redis.Redis, limits: dict[tuple[int, int], tuple[float, float]]) -> None:
    """Admission rates as the control plane publishes them (its code): (guaranteed,
    best-effort) MU/min, the first a reservation floor, the second the tick's allowance."""
    set_rates(Buckets(client, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600), limits)


@pytest.fixture
def start_emulator(tmp_path):
    """Start emulator subprocesses (each one replica endpoint); yields (url, process)."""
    with _Stack() as stack:

        def start(config: dict | None = None, args: tuple[str, ...] = ()):
            config = config or {"seed": 0, "models": [tiny_model()]}
            return stack.enter(emulator_subprocess(config, tmp_path, args))

        yield start


class _Stack:
    def __init__(self):
        self._contexts = []

    def enter(self, context):
        value = context.__enter__()
        self._contexts.append(context)
        return value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)


@pytest.fixture
def usage_server() -> Iterator[RecordingServer]:
    with RecordingServer(body=USAGE_OK) as server:
        yield server


def usage_events(server: RecordingServer) -> list[dict]:
    events = []
    for request in list(server.requests):
        if request.path == "/api/v1/usage/events" and server.status == 200:
            events.extend(json.loads(request.body)["events"])
    return events


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen
    log_path: Path
    env: dict = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text()


@contextmanager
def gateway_process(tmp_path: Path, **env: str) -> Iterator[Gateway]:
    port = free_port()
    log_path = tmp_path / f"gateway-{port}.log"
    full_env = {
        **os.environ,
        "GATEWAY_PORT": str(port),
        "GATEWAY_WORKERS": "1",
        "GATEWAY_REDIS_URL": os.environ["REDIS_URL"],
        "GATEWAY_SERVICE_KEY": SERVICE_KEY,
        "GATEWAY_USAGE_FLUSH_SECONDS": "0.2",
        "GATEWAY_SPOOL_RETRY_SECONDS": "0.5",
        "GATEWAY_REFRESH_SECONDS": "0.5",
        "GATEWAY_COLD_START_WAIT_SECONDS": "10",
        "GATEWAY_TOKEN_TIMEOUT_SECONDS": "5",
        # Within stop()'s 15 s, so a test's gateway hands its usage over before the kill.
        "GATEWAY_SHUTDOWN_GRACE_SECONDS": "3",
        **env,
    }
    full_env.pop("DJANGO_SETTINGS_MODULE", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "dataplane.gateway"],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url + "/readyz", process, what="the gateway", log_path=log_path)
        yield Gateway(url=url, process=process, log_path=log_path, env=full_env)
    finally:
        stop(process, timeout_seconds=15)


@pytest.fixture
def start_gateway(tmp_path, usage_server):
    with _Stack() as stack:

        def start(**env: str) -> Gateway:
            env.setdefault("GATEWAY_CONTROL_PLANE_URL", usage_server.url)
            return stack.enter(gateway_process(tmp_path, **env))

        yield start


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as client:
        yield client


def wait_for(predicate, timeout_seconds: float = 10.0, poll_seconds: float = 0.05):
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_seconds} s")
        time.sleep(poll_seconds)


def wait_for_workers(client: redis.Redis, workers: int) -> None:
    """Until `workers` gateway workers have read the contract: each beats in gw:v1:workers once
    it has, just before it listens. The gateway's /readyz is answered by whichever worker is up
    first; on a loaded machine the others may still be starting (a test that kills or faults
    one must wait for all)."""
    wait_for(lambda: client.hlen(C.WORKERS) >= workers, timeout_seconds=60)


def bearer(key: C.Key | str) -> dict[str, str]:
    text = key if isinstance(key, str) else key.plaintext
    return {"Authorization": f"Bearer {text}"}


@dataclass
class World:
    """One published contract: customer acme (id 1) with a key, model `tiny` (id 7)."""

    rds: redis.Redis
    publication: C.Publication
    acme: C.Key
    version: int = 0

    def publish(self) -> int:
        self.version = C.publish(self.rds, self.publication)
        return self.version


@pytest.fixture
def world(rds) -> World:
    acme = C.key(customer_id=1, customer="acme")
    publication = C.Publication(
        keys={acme.prefix: acme.doc},
        models={},
        entitlements={1: ["tiny"]},
    )
    set_limits(rds, {(1, 7): (1000.0, 1000.0)})
    return World(rds=rds, publication=publication, acme=acme)
