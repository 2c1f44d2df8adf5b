"""Real processes for end-to-end tests: the engine emulator and a Celery worker."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from django.db import connection

from tests.support.subprocesses import START_SECONDS, stop, wait_until_answering

ROOT = Path(__file__).resolve().parents[2]


# Ports for the servers tests start: below Linux's ephemeral range (32768-60999), which the
# kernel hands to outgoing connections and to bind(port 0), so a port chosen here and bound a
# moment later by the server cannot have been taken meanwhile by a connection or by another
# xdist worker's choice. Each worker (gw0, gw1, ...) owns its own slice of the range.
# The timing-sensitive pass (no xdist) has slice 0, worker gwN slice N + 1; a pass run beside
# another (make test's SQLite pass) moves its workers' slices up by TEST_PORT_SLICE_OFFSET.
_PORT_SLICE = 1000
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_SLICE_INDEX = (
    int(_WORKER[2:]) + 1 + int(os.environ.get("TEST_PORT_SLICE_OFFSET", "0"))
    if _WORKER[2:].isdigit()
    else 0
)
_PORT_BASE = 20000 + _PORT_SLICE * _SLICE_INDEX
if _PORT_BASE + _PORT_SLICE > 32768:
    raise RuntimeError(f"port slice {_SLICE_INDEX} reaches Linux's ephemeral range (32768+)")
_port_offset = 0


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive free ports in this worker's slice; successive calls
    move on through the slice, so a port a test just closed is not handed out again soon."""
    global _port_offset
    for _ in range(_PORT_SLICE):
        if _port_offset + count > _PORT_SLICE:
            _port_offset = 0
        first = _PORT_BASE + _port_offset
        _port_offset += count
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports in {_PORT_BASE}+{_PORT_SLICE}")


def free_port() -> int:
    return free_ports(1)


def emulator_command(config_path, port: int, *args: str) -> list[str]:
    """The argv that starts the engine emulator (`python -m dataplane.emulator`)."""
    return [
        sys.executable, "-m", "dataplane.emulator", "--port", str(port),
        "--config", str(config_path), *args,
    ]  # fmt: skip


@contextmanager
def emulator_process(config: dict, tmp_path: Path, args: tuple[str, ...] = ()):
    """An emulator subprocess serving `config`; yields its base URL. `args`: extra flags."""
    with emulator_subprocess(config, tmp_path, args) as (base_url, _process):
        yield base_url


@contextmanager
def emulator_subprocess(config: dict, tmp_path: Path, args: tuple[str, ...] = ()):
    """Like `emulator_process`, yielding `(base_url, process)` for tests that watch it exit."""
    port = free_port()
    config_path = tmp_path / f"emulator-{port}.json"
    config_path.write_text(json.dumps(config))
    log = open(tmp_path / f"emulator-{port}.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        emulator_command(config_path, port, *args),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(
            base_url + "/health",
            process,
            what="the emulator",
            log_path=tmp_path / f"emulator-{port}.log",
        )
        yield base_url, process
    finally:
        stop(process, timeout_seconds=10)
        log.close()


def test_database_url() -> str:
    """The URL of the database the tests run in, so a worker process sees the same rows."""
    settings_dict = connection.settings_dict
    user = settings_dict.get("USER") or "postgres"
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else f"{user}@"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{settings_dict['NAME']}"


@contextmanager
def celery_worker_process(tmp_path: Path, *, queues: str = "benchmarks,default"):
    from controlplane.celery import app

    app.control.purge()
    log_path = tmp_path / "worker.log"
    env = os.environ | {"DATABASE_URL": test_database_url()}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "--queues",
            queues,
            "--pool",
            "solo",
            "--concurrency",
            "1",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--hostname",
            f"e2e-{uuid.uuid4().hex[:8]}@%h",
            "--loglevel",
            "INFO",
            "--logfile",
            str(log_path),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_SECONDS
        while "ready" not in (log_path.read_text() if log_path.exists() else ""):
            if process.poll() is not None or time.monotonic() > deadline:
                text = log_path.read_text() if log_path.exists() else "(no log)"
                raise RuntimeError("the Celery worker did not start: " + text[-2000:])
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def celery_worker_as(name: str, tmp_path: Path, *, include: str = ""):
    """The worker `name` of controlplane/workers.py (its queues and processes, as `make run`
    starts it), on the test database; `include`: a module of test tasks it imports too."""
    from controlplane.workers import WORKERS

    log_path = tmp_path / f"{name}-worker-{uuid.uuid4().hex[:8]}.log"
    env = os.environ | {"DATABASE_URL": test_database_url()}
    # Its own node name: another test's worker of the same kind may run beside it.
    arguments = [a for a in WORKERS[name].arguments(name) if not a.startswith("--hostname=")]
    arguments.append(f"--hostname={name}-{uuid.uuid4().hex[:8]}@%h")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", *arguments,
         "--without-gossip", "--without-mingle", "--loglevel", "INFO",
         "--logfile", str(log_path), *(["--include", include] if include else [])],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_SECONDS
        while "ready" not in (log_path.read_text() if log_path.exists() else ""):
            if process.poll() is not None or time.monotonic() > deadline:
                text = log_path.read_text() if log_path.exists() else "(no log)"
                raise RuntimeError(f"the {name} worker did not start: " + text[-2000:])
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def celery_beat_process(tmp_path: Path, *, max_interval_seconds: int = 1):
    """Celery beat on the test database's django-celery-beat tables (the DatabaseScheduler,
    as `make run` and production run it): the periodic tasks the test wrote are what fires."""
    log_path = tmp_path / f"beat-{uuid.uuid4().hex[:8]}.log"
    env = os.environ | {"DATABASE_URL": test_database_url()}
    process = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "controlplane", "beat",
            "--scheduler", "django_celery_beat.schedulers:DatabaseScheduler",
            "--max-interval", str(max_interval_seconds),
            "--pidfile", str(tmp_path / f"beat-{uuid.uuid4().hex[:8]}.pid"),
            "--loglevel", "INFO", "--logfile", str(log_path),
        ],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_SECONDS
        while "beat: Starting" not in (log_path.read_text() if log_path.exists() else ""):
            if process.poll() is not None or time.monotonic() > deadline:
                text = log_path.read_text() if log_path.exists() else "(no log)"
                raise RuntimeError(f"Celery beat did not start (exit {process.poll()}): {text}")
            time.sleep(0.2)
        yield process
    finally:
        stop(process, timeout_seconds=10)
