"""The process supervisor, starting and stopping real engine emulators.

The supervisor runs only its own engines (named argv templates); the process actuator
(tests/capacity/actuation/test_process_actuator.py) names one."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import httpx
import pytest

from dataplane.supervisor.supervisor import (
    DeploymentSpec,
    SpecError,
    parse_engines,
    parse_scale_request,
)
from tests.dataplane.supervisor.support import (
    ROOT,
    StreamedRequest,
    free_port_range,
    healthy,
    port_open,
    process_gone,
    ready_count,
    replicas_of,
    wait_until,
)


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


def test_the_command_stops_its_replicas_on_sigterm(tmp_path, emulator_command):
    # One range, so the API's port cannot also be handed out as the engine's.
    port = free_port_range(2)
    base_port = port + 1
    env = os.environ | {"PROCESS_SUPERVISOR_TOKEN": ""}
    engine = "emulator=" + shlex.join(emulator_command)
    process = subprocess.Popen(
        [sys.executable, "-m", "dataplane.supervisor", "--port", str(port),
         "--log-dir", str(tmp_path / "logs"), "--engine", engine],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # Give a loaded machine time to start the child.
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
