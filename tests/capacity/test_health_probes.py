"""Inference probes against real engine emulators run by the real process supervisor:
fingerprints, a hung replica found, restarted and serving again, its capacity out of the
allocation snapshot meanwhile, and every step timed."""

import contextlib
import os
import signal

import pytest
from django.utils import timezone

from capacity.actuator_config import validate_actuator_config
from capacity.allocation_tick import allocation_tick
from capacity.health import probe_round
from capacity.models import (
    ActuatorKind,
    DeploymentFingerprint,
    Incident,
    IncidentStep,
    ProbeResult,
    Replica,
)
from tests.capacity.test_process_actuator import (  # noqa: F401 - fixtures
    emulator_command,
    free_port_range,
    http_supervisor,
    supervisor,
    wait_until,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def fast_probes(settings):
    settings.HEALTH_PROBE_TIMEOUT_SECONDS = 1.0
    settings.HEALTH_PROBE_FAILURES = 3
    settings.HEALTH_PROBE_QUIET_SECONDS = 0


@pytest.fixture
def process_deployment(
    sellable,
    served_model,
    http_supervisor,  # noqa: F811
    emulator_command,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setenv("TEST_SUPERVISOR_TOKEN", "s3cret-token")  # http_supervisor's token
    served_model.engine_model_id = "tiny"  # what the emulator config serves
    served_model.save()
    deployment = served_model.deployments.get()
    deployment.actuator_kind = ActuatorKind.PROCESS
    deployment.actuator_config = validate_actuator_config(
        ActuatorKind.PROCESS,
        {
            "command": list(emulator_command),
            "base_port": free_port_range(3),
            "supervisor_url": http_supervisor.url,
            "drain_seconds": 1,
            "token_env": "TEST_SUPERVISOR_TOKEN",
        },
    )
    deployment.min_replicas = 2
    deployment.max_replicas = 3
    deployment.save()
    # The tick starts two replicas through the supervisor.
    tick = allocation_tick()
    assert tick.applied == 1, tick.decisions
    running = http_supervisor.supervisor
    wait_until(
        lambda: running.deployment_status(deployment.name)["ready"] == 2,
        what="two ready replicas",
        detail=lambda: running.deployment_status(deployment.name),
    )
    deployment.refresh_from_db()
    assert deployment.current_replicas == 2
    return deployment


def test_healthy_replicas_answer_and_the_first_answer_becomes_the_fingerprint(
    process_deployment, fast_probes
):
    result = probe_round()
    assert (result.probed, result.failed, result.errors) == (2, 0, [])
    replicas = list(Replica.objects.filter(deployment=process_deployment))
    assert [(r.key, r.state) for r in replicas] == [
        ("process:0", "healthy"),
        ("process:1", "healthy"),
    ]
    fingerprint = DeploymentFingerprint.objects.get(deployment=process_deployment)
    assert fingerprint.answer and fingerprint.recorded_from == "process:0"
    assert all(r.last_latency_ms < 1000 for r in replicas)
    # Both replicas give the same answer, again and again.
    for _ in range(2):
        assert probe_round().failed == 0
    assert ProbeResult.objects.filter(outcome="ok").count() == 6


def test_a_hung_replica_is_detected_restarted_replaced_and_serving_again(
    process_deployment,
    fast_probes,
    http_supervisor,  # noqa: F811
):
    probe_round()
    running = http_supervisor.supervisor

    def status():
        return running.deployment_status(process_deployment.name)

    hung_pid = status()["replicas"][1]["pid"]
    # A stopped process keeps its socket: connections are accepted and never answered,
    # exactly how an engine hangs. Its supervisor still reports it ready.
    os.killpg(hung_pid, signal.SIGSTOP)
    try:
        rounds = 0
        while not Incident.objects.exists():
            rounds += 1
            assert rounds <= 3, "three failed probes in a row mark it unhealthy"
            probe_round()
        incident = Incident.objects.get()
        assert incident.cause == "timeout" and incident.replica.key == "process:1"
        assert Replica.objects.get(key="process:1").state == Replica.State.UNHEALTHY
        assert incident.restart_requested_at is not None
        # The supervisor killed the hung engine and started another on the same port.
        wait_until(lambda: status()["replicas"][1]["pid"] != hung_pid, what="a new process")

        # Meanwhile its capacity is out of the snapshot: the tick adds a replacement.
        tick = allocation_tick()
        (decision,) = tick.decisions
        assert decision["target_replicas"] == 3
        assert "unhealthy_replicas" in [r["code"] for r in decision["reasons"]]

        wait_until(lambda: status()["ready"] >= 2, what="the restarted replica ready")
        wait_until(
            lambda: probe_round() and Incident.objects.get().ready_at is not None,
            timeout_seconds=20,
            what="a good probe of the restarted replica",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hung_pid, signal.SIGCONT)
    incident = Incident.objects.get()
    steps = list(incident.steps.values_list("step", flat=True))
    assert steps == [
        IncidentStep.Step.FIRST_FAILURE,
        IncidentStep.Step.DETECTED,
        IncidentStep.Step.RESTART_REQUESTED,
        IncidentStep.Step.READY,
    ]
    times = list(incident.steps.values_list("at", flat=True))
    assert times == sorted(times)
    assert 0 < incident.seconds_to_ready < 30
    assert Replica.objects.get(key="process:1").state == Replica.State.HEALTHY
    assert incident.ready_at <= timezone.now()
