"""The process actuator, starting and stopping real engine emulators through the process
supervisor's API (the supervisor itself: tests/dataplane/supervisor/).

The supervisor runs only its own engines (named argv templates); the actuator names one."""

import httpx
import pytest

from capacity.actuation.base import PermanentActuatorError, ScaleRequest, TransientActuatorError
from capacity.actuation.config import validate_actuator_config
from capacity.actuation.process import ProcessActuator
from core.errors import DomainError
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    emulator_command,
    engines,
    free_port_range,
    healthy,
    http_supervisor,
    port_open,
    process_gone,
    supervisor,
    wait_until,
)
from tests.support.recording_server import RecordingServer
from tests.support.secret_bindings import bind_secret


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
    http_supervisor,  # noqa: F811
    monkeypatch,
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


def test_the_actuator_tells_transient_from_permanent_failures(
    http_supervisor,  # noqa: F811
    monkeypatch,
    settings,
):
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")
    # Bound to this supervisor, and never set.
    bind_secret(settings, "MU_ACTUATOR_NO_SUCH_TOKEN", "supervisor", http_supervisor.url)
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


def test_a_token_is_not_read_for_a_supervisor_it_is_no_longer_bound_to(
    http_supervisor,  # noqa: F811
    monkeypatch,
    settings,
):
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")
    with RecordingServer() as listener:
        # Valid when written: the operator had bound the token to this listener.
        bind_secret(settings, "MU_ACTUATOR_SUPERVISOR_TOKEN", "supervisor", listener.url)
        config = {
            "engine": "sleeper",
            "base_port": 9000,
            "supervisor_url": listener.url,
            "token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN",
        }
        request = scale_request(config, 1)
        # Bound to the real supervisor since.
        bind_secret(settings, "MU_ACTUATOR_SUPERVISOR_TOKEN", "supervisor", http_supervisor.url)

        with pytest.raises(PermanentActuatorError) as refused:
            ProcessActuator(timeout_seconds=2).apply(request)

    assert str(refused.value).startswith(
        "actuator_config.token_env: MU_ACTUATOR_SUPERVISOR_TOKEN may be sent only to the process "
        f"supervisor at {http_supervisor.url}"
    )
    assert listener.requests == []


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
