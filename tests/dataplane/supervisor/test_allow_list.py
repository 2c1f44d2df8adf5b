"""Issue 15 (docs/design.md#trust), the supervisor's side: no command through its API, only
the engines of the operator's allow-list, and no start without one (the control plane's side:
tests/capacity/test_trust_boundaries.py)."""

import threading

import httpx
import pytest

from dataplane.supervisor.server import CommandError, make_server, run
from dataplane.supervisor.supervisor import ProcessSupervisor
from tests.dataplane.supervisor.support import free_port_range, wait_until


@pytest.fixture
def running_supervisor(tmp_path):
    engines = {"sleeper": ("sleep", "60", "{port}")}
    supervisor = ProcessSupervisor(engines=engines, log_dir=tmp_path / "logs").start()
    server = make_server(supervisor, port=0)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    supervisor.shutdown(drain=False)


def test_a_running_supervisor_refuses_a_command_and_runs_only_its_own_engines(
    running_supervisor, tmp_path
):
    owned = tmp_path / "owned"
    scale = f"{running_supervisor.url}/scale"
    base = {"deployment": "llm", "replicas": 1, "base_port": free_port_range(1)}

    with_command = httpx.post(
        scale, json=base | {"command": ["/bin/sh", "-c", f"id > {owned}", "{port}"]}, timeout=5
    )
    unknown = httpx.post(scale, json=base | {"engine": "shell"}, timeout=5)
    known = httpx.post(scale, json=base | {"engine": "sleeper"}, timeout=5)

    assert with_command.status_code == 400
    assert "runs only the engines of its own allow-list" in with_command.json()["error"]
    assert unknown.status_code == 400
    assert unknown.json()["error"] == (
        "engine: 'shell' is not an engine of this supervisor (known: sleeper)."
    )
    assert known.status_code == 200
    assert known.json()["engine"] == "sleeper"
    status = httpx.get(f"{running_supervisor.url}/status", timeout=5).json()
    assert status["deployments"]["llm"]["engine"] == "sleeper"
    assert "command" not in status["deployments"]["llm"]
    wait_until(lambda: status_pid(running_supervisor), what="the sleeper to start")
    assert not owned.exists()


def status_pid(server) -> int | None:
    status = httpx.get(f"{server.url}/status", timeout=5).json()
    return status["deployments"]["llm"]["replicas"][0]["pid"]


def test_the_supervisor_will_not_start_without_an_engine_allow_list():
    with pytest.raises(CommandError, match="No engine to run"):
        run(["--port", "0"])
    with pytest.raises(CommandError, match='must contain "{port}"'):
        run(["--port", "0", "--engine", "vllm=vllm serve x"])
