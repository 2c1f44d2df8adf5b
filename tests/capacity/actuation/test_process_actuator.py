"""The process actuator and its supervisor, starting and stopping real engine emulators.

The supervisor runs only its own engines (named argv templates); the actuator names one."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from capacity.actuation.base import PermanentActuatorError, ScaleRequest, TransientActuatorError
from capacity.actuation.config import validate_actuator_config
from capacity.actuation.process import ProcessActuator
from capacity.management.commands.run_process_supervisor import make_server
from capacity.process_supervisor import (
    DeploymentSpec,
    ProcessSupervisor,
    SpecError,
    parse_engines,
    parse_scale_request,
)
from controlplane.errors import DomainError

ROOT = Path(__file__).resolve().parents[3]

# About 2.7 ms per decode step alone, so a request's length in seconds is set by max_tokens.
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
# Never listens, so never ready: for what needs a process but no engine.
SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)", "--port", "{port}")
# The supervisor's allow-list in these tests, besides the emulator engines (see `engines`).
OTHER_ENGINES = {
    "sleeper": SLEEPER,
    "sleeper-v2": (*SLEEPER, "--v2"),
    "missing": ("/nonexistent/engine", "--port", "{port}"),
}


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base_port = sock.getsockname()[1]
        if base_port + count > 65535:
            continue
        try:
            for port in range(base_port, base_port + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base_port
    raise RuntimeError(f"no {count} consecutive free ports")


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
        "benchmarking.emulator",
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


def start_two(supervisor, *, drain_seconds: float = 10.0):
    base_port = free_port_range(2)
    spec = DeploymentSpec("emulator", "127.0.0.1", base_port, drain_seconds)
    supervisor.scale("llm", 2, spec)
    wait_until(
        lambda: ready_count(supervisor, "llm") == 2,
        what="two ready replicas",
        detail=lambda: supervisor.deployment_status("llm"),
    )
    return spec, base_port, [replica["pid"] for replica in replicas_of(supervisor, "llm")]


def test_it_starts_replicas_on_consecutive_ports_and_stops_the_highest_first(
    supervisor, emulator_command
):
    base_port = free_port_range(2)
    spec = DeploymentSpec("emulator", "127.0.0.1", base_port, drain_seconds=10)

    status = supervisor.scale("llm", 2, spec)

    assert status["target"] == 2
    assert [(r["replica"], r["port"]) for r in status["replicas"]] == [
        (0, base_port),
        (1, base_port + 1),
    ]
    assert {r["state"] for r in status["replicas"]} == {"starting"}
    wait_until(
        lambda: ready_count(supervisor, "llm") == 2,
        what="two ready replicas",
        detail=lambda: supervisor.deployment_status("llm"),
    )
    assert healthy(base_port) and healthy(base_port + 1)
    first_pid, second_pid = (r["pid"] for r in replicas_of(supervisor, "llm"))

    supervisor.scale("llm", 1, spec)

    wait_until(lambda: len(replicas_of(supervisor, "llm")) == 1, what="replica 1 to go")
    assert process_gone(second_pid)
    assert not port_open(base_port + 1)
    (remaining,) = replicas_of(supervisor, "llm")
    assert (remaining["port"], remaining["pid"], remaining["state"]) == (
        base_port,
        first_pid,
        "ready",
    )
    assert healthy(base_port)

    supervisor.scale("llm", 0, spec)

    wait_until(lambda: not replicas_of(supervisor, "llm"), what="every replica to go")
    assert process_gone(first_pid)
    assert not port_open(base_port)
    assert supervisor.deployment_status("llm")["target"] == 0


def test_it_restarts_a_replica_that_crashes(supervisor, emulator_command):
    spec = DeploymentSpec("emulator", "127.0.0.1", free_port_range(1), drain_seconds=5)
    supervisor.scale("llm", 1, spec)
    wait_until(
        lambda: ready_count(supervisor, "llm") == 1,
        what="a ready replica",
        detail=lambda: supervisor.deployment_status("llm"),
    )
    (before,) = replicas_of(supervisor, "llm")

    os.kill(before["pid"], signal.SIGKILL)

    after = wait_until(
        lambda: next(
            (
                r
                for r in replicas_of(supervisor, "llm")
                if r["restarts"] == 1 and r["state"] == "ready"
            ),
            None,
        ),
        what="the replica to be restarted and ready",
        detail=lambda: supervisor.deployment_status("llm"),
    )
    assert after["pid"] != before["pid"]
    assert after["port"] == before["port"]
    assert after["last_error"] == "killed by SIGKILL"
    assert healthy(after["port"])


def test_a_replica_removed_mid_request_finishes_it_before_it_is_stopped(
    supervisor, emulator_command
):
    spec, base_port, (_, second_pid) = start_two(supervisor)
    # ~2.7 s of tokens: longer than the wait below, so SIGTERM would show as a closed port.
    request = StreamedRequest(base_port + 1, max_tokens=1000)
    request.start()
    assert request.first_token.wait(5) and request.error is None

    supervisor.scale("llm", 1, spec)
    time.sleep(1.0)

    draining = [r for r in replicas_of(supervisor, "llm") if r["replica"] == 1]
    assert [r["state"] for r in draining] == ["draining"]
    assert healthy(base_port + 1), "SIGTERM came while a request was in flight"
    assert not request.done
    request.join(10)
    assert (request.done, request.tokens, request.finish_reason) == (True, 1000, "length")
    wait_until(lambda: process_gone(second_pid), timeout_seconds=5, what="the drained process")
    assert not port_open(base_port + 1)
    wait_until(lambda: len(replicas_of(supervisor, "llm")) == 1, what="replica 1 to be dropped")


def test_a_replica_that_outlasts_its_drain_time_is_killed(supervisor, emulator_command):
    supervisor.term_grace_seconds = 0.5
    spec, base_port, (_, second_pid) = start_two(supervisor, drain_seconds=0.5)
    request = StreamedRequest(base_port + 1, max_tokens=3000)  # ~8 s
    request.start()
    assert request.first_token.wait(5)
    removed_at = time.monotonic()

    supervisor.scale("llm", 1, spec)

    wait_until(lambda: process_gone(second_pid), timeout_seconds=5, what="the killed process")
    # drain time + grace + a monitor pass, well short of the request or the engine's own
    # shutdown wait (~5 s).
    assert time.monotonic() - removed_at < 3.0
    request.join(5)
    assert not request.done and request.tokens < 3000


def test_scaling_up_while_draining_keeps_the_draining_replica(supervisor, emulator_command):
    spec, base_port, (_, second_pid) = start_two(supervisor)
    request = StreamedRequest(base_port + 1, max_tokens=400)  # ~1 s
    request.start()
    assert request.first_token.wait(5)
    supervisor.scale("llm", 1, spec)
    assert [r["state"] for r in replicas_of(supervisor, "llm")] == ["ready", "draining"]

    status = supervisor.scale("llm", 2, spec)

    assert [(r["pid"], r["state"]) for r in status["replicas"]][1] == (second_pid, "ready")
    request.join(10)
    assert request.done
    time.sleep(0.3)  # a drain thread that had not noticed would have signalled by now
    assert not process_gone(second_pid) and healthy(base_port + 1)


def test_a_changed_engine_replaces_the_replicas(supervisor):
    base_port = free_port_range(1)
    supervisor.scale("llm", 1, DeploymentSpec("sleeper", "127.0.0.1", base_port, 5))
    (old,) = replicas_of(supervisor, "llm")

    supervisor.scale("llm", 1, DeploymentSpec("sleeper-v2", "127.0.0.1", base_port, 5))

    new = wait_until(
        lambda: next((r for r in replicas_of(supervisor, "llm") if r["pid"] != old["pid"]), None),
        what="a replacement",
    )
    assert new["port"] == base_port and new["state"] == "starting"
    wait_until(lambda: process_gone(old["pid"]), timeout_seconds=5, what="the old process")


def test_it_refuses_a_port_range_that_overlaps_another_deployment(supervisor):
    base_port = free_port_range(3)
    supervisor.scale("a", 2, DeploymentSpec("sleeper", "127.0.0.1", base_port, 0))

    with pytest.raises(SpecError, match=f"port {base_port + 1} .* deployment 'a'"):
        supervisor.scale("b", 2, DeploymentSpec("sleeper", "127.0.0.1", base_port + 1, 0))
    assert supervisor.deployment_status("b") is None


def test_an_engine_that_cannot_start_is_reported(supervisor):
    spec = DeploymentSpec("missing", "127.0.0.1", free_port_range(1), 0)

    status = supervisor.scale("llm", 1, spec)

    (replica,) = status["replicas"]
    assert replica["state"] == "crashed" and replica["pid"] is None
    assert "cannot start '/nonexistent/engine'" in replica["last_error"]


@pytest.fixture
def http_supervisor(supervisor):
    server = make_server(supervisor, port=0, token="s3cret-token")
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def scale_request(config: dict, replicas: int) -> ScaleRequest:
    return ScaleRequest(
        deployment_id=1,
        deployment="llm-process",
        model="tiny",
        target_replicas=replicas,
        current_replicas=0,
        config=validate_actuator_config("process", config),
    )


def test_the_actuator_starts_and_stops_emulators_through_the_supervisor_api(
    http_supervisor, monkeypatch
):
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")
    base_port = free_port_range(2)
    config = {
        "engine": "emulator",
        "base_port": base_port,
        "supervisor_url": http_supervisor.url,
        "drain_seconds": 5,
        "token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN",
    }
    actuator = ProcessActuator()
    headers = {"Authorization": "Bearer s3cret-token"}

    def status():
        response = httpx.get(f"{http_supervisor.url}/status", headers=headers, timeout=5)
        assert response.status_code == 200
        return response.json()["deployments"]["llm-process"]

    # The supervisor answers before the engines are up; the next tick sees them ready.
    assert actuator.apply(scale_request(config, 2)) in (0, 1, 2)
    wait_until(lambda: status()["ready"] == 2, what="two ready replicas", detail=status)
    assert actuator.apply(scale_request(config, 2)) == 2
    pids = [replica["pid"] for replica in status()["replicas"]]
    assert healthy(base_port) and healthy(base_port + 1)

    assert actuator.apply(scale_request(config, 0)) == 0

    wait_until(lambda: not status()["replicas"], what="every replica to go")
    assert all(process_gone(pid) for pid in pids)
    assert not port_open(base_port) and not port_open(base_port + 1)


def test_the_actuator_tells_transient_from_permanent_failures(http_supervisor, monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")
    config = {"engine": "sleeper", "base_port": 65535, "supervisor_url": http_supervisor.url}
    actuator = ProcessActuator(timeout_seconds=2)

    # 2 replicas from 65535: the supervisor refuses the request itself (400).
    with pytest.raises(PermanentActuatorError, match="answered 400: base_port"):
        actuator.apply(scale_request(config | {"token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN"}, 2))
    # No token configured, the supervisor wants one (401).
    with pytest.raises(PermanentActuatorError, match="answered 401"):
        actuator.apply(scale_request(config, 1))
    with pytest.raises(PermanentActuatorError, match="MU_ACTUATOR_NO_SUCH_TOKEN"):
        actuator.apply(scale_request(config | {"token_env": "MU_ACTUATOR_NO_SUCH_TOKEN"}, 1))
    # Nothing listening: worth another try.
    down = config | {"supervisor_url": f"http://127.0.0.1:{free_port_range(1)}"}
    with pytest.raises(TransientActuatorError, match="ConnectError"):
        actuator.apply(scale_request(down, 1))
    assert httpx.get(f"{http_supervisor.url}/status", timeout=5).status_code == 401


def test_the_command_stops_its_replicas_on_sigterm(tmp_path, emulator_command):
    # One range, so the API's port cannot also be handed out as the engine's.
    port = free_port_range(2)
    base_port = port + 1
    env = os.environ | {"PROCESS_SUPERVISOR_TOKEN": ""}
    engine = "emulator=" + shlex.join(emulator_command)
    process = subprocess.Popen(
        [sys.executable, "manage.py", "run_process_supervisor", "--port", str(port),
         "--log-dir", str(tmp_path / "logs"), "--engine", engine],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # Django starts in the child first: give a loaded machine time.
        wait_until(lambda: healthy(port), timeout_seconds=45, what="the supervisor's API")
        body = {
            "deployment": "llm",
            "replicas": 1,
            "engine": "emulator",
            "base_port": base_port,
            "drain_seconds": 5,
        }
        assert httpx.post(f"{url}/scale", json=body, timeout=5).status_code == 200
        wait_until(
            lambda: httpx.get(f"{url}/status", timeout=5).json()["deployments"]["llm"]["ready"],
            what="a ready replica",
            detail=lambda: httpx.get(f"{url}/status", timeout=5).json(),
        )
        (replica,) = httpx.get(f"{url}/status", timeout=5).json()["deployments"]["llm"]["replicas"]

        process.send_signal(signal.SIGTERM)

        assert process.wait(timeout=10) == 0
        assert process_gone(replica["pid"])
        assert not port_open(base_port)
        assert "Process supervisor stopped." in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_process_config_names_an_engine_and_fills_in_defaults():
    with pytest.raises(DomainError) as refused:
        validate_actuator_config("process", {"engine": "Bad Engine!", "base_port": 9000})
    assert refused.value.field == "actuator_config.engine"

    config = validate_actuator_config("process", {"engine": "vllm-llama-8b", "base_port": 9000})
    assert config == {
        "engine": "vllm-llama-8b",
        "host": "127.0.0.1",
        "base_port": 9000,
        "supervisor_url": "http://127.0.0.1:8190",
        "drain_seconds": 30.0,
    }
    for bad, field in [
        ({"drain_seconds": 3601}, "drain_seconds"),
        ({"supervisor_url": "ftp://gpu-07"}, "supervisor_url"),
        ({"token_env": "lower"}, "token_env"),
        ({"host": "--help"}, "host"),
    ]:
        with pytest.raises(DomainError) as refused:
            validate_actuator_config("process", config | bad)
        assert refused.value.field == f"actuator_config.{field}"
    assert validate_actuator_config("process", config | {"supervisor_url": "http://localhost:8190"})


def test_the_supervisor_checks_a_scale_request_and_substitutes_placeholders():
    name, replicas, spec = parse_scale_request(
        {"deployment": "llm", "replicas": 2, "engine": "vllm", "base_port": 9000}
    )
    assert (name, replicas, spec.engine, spec.drain_seconds) == ("llm", 2, "vllm", 30.0)
    template = ("serve", "--port={port}", "--gpu", "{replica}", '{"json": 1}')
    assert spec.argv(template, 1) == ["serve", "--port=9001", "--gpu", "1", '{"json": 1}']
    for bad, message in [
        ({"engine": "../bin/sh"}, "engine"),
        ({"replicas": -1}, "replicas"),
        ({"deployment": "../etc"}, "deployment"),
        ({"drain_seconds": True}, "drain_seconds"),
        ({"host": "-oProxyCommand=x"}, "host"),
        ({"extra": 1}, "unknown"),
    ]:
        body = {"deployment": "llm", "replicas": 1, "engine": "vllm", "base_port": 9000}
        with pytest.raises(SpecError, match=message):
            parse_scale_request(body | bad)


def test_the_supervisor_reads_its_engines_from_flags_and_a_file(tmp_path):
    engines_file = tmp_path / "engines.json"
    engines_file.write_text(json.dumps({"qwen": ["vllm", "serve", "qwen", "--port", "{port}"]}))

    # As the shell hands over --engine llama='vllm serve … --port {port}' (quotes gone).
    engines = parse_engines(
        ["llama=vllm serve meta-llama/Llama-3.1-8B --chat-template '{\"x\": 1}' --port {port}"],
        engines_file,
    )

    assert engines == {
        "llama": (
            "vllm",
            "serve",
            "meta-llama/Llama-3.1-8B",
            "--chat-template",
            '{"x": 1}',
            "--port",
            "{port}",
        ),
        "qwen": ("vllm", "serve", "qwen", "--port", "{port}"),
    }
    for options, message in [
        (["llama=vllm serve"], '"{port}"'),
        (["Bad=x {port}"], "engine name"),
        (["llama"], "NAME="),
        (["qwen=x {port}"], "given twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_engines(options, engines_file)
