"""Inference probes against real engine emulators run by the real process supervisor:
fingerprints, a hung replica found, restarted and serving again, its capacity out of the
allocation snapshot meanwhile, and every step timed."""

import contextlib
import os
import signal

import httpx
import pytest
from django.utils import timezone

from capacity.actuation.config import validate_actuator_config
from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_round
from capacity.models import (
    ActuatorKind,
    DeploymentFingerprint,
    Incident,
    IncidentStep,
    ProbeResult,
    Replica,
)
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    emulator_command,
    engines,
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
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")  # http_supervisor's
    served_model.engine_model_id = "tiny"  # what the emulator config serves
    served_model.save()
    deployment = served_model.deployments.get()
    deployment.actuator_kind = ActuatorKind.PROCESS
    deployment.actuator_config = validate_actuator_config(
        ActuatorKind.PROCESS,
        {
            # As a production fleet runs vLLM: admission's priorities need the priority policy.
            "engine": "emulator-priority",
            "base_port": free_port_range(3),
            "supervisor_url": http_supervisor.url,
            "drain_seconds": 1,
            "token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN",
        },
    )
    deployment.min_replicas = 2
    deployment.max_replicas = 3
    deployment.priority_scheduling = True  # the engines run `--scheduling-policy priority`
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
    # Read from the engine's own vllm:num_requests_running (idle now): a scale-down takes
    # the least loaded first.
    assert [r.running_requests for r in replicas] == [0.0, 0.0]
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
    port = status()["replicas"][1]["port"]
    # The engine hangs: it accepts requests and never answers them, while /health still
    # answers 200, so its supervisor still reports it ready.
    fault = httpx.post(f"http://127.0.0.1:{port}/emulator/faults", json={"mode": "hang"})
    assert fault.status_code == 200
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
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
        with contextlib.suppress(ProcessLookupError, httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/emulator/faults", json={"mode": "none"})
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


@pytest.fixture
def k8s_api(monkeypatch, settings):
    from tests.support.scale_api import ScaleApiServer

    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "k8s-token")
    server = ScaleApiServer(token="k8s-token").start()
    settings.KUBERNETES_CLUSTERS = {
        "local": {"api_server": server.url, "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }
    yield server
    server.stop()


def test_a_hung_pod_is_deleted_and_its_replacement_closes_the_incident(
    sellable, served_model, k8s_api, tmp_path, fast_probes
):
    from tests.dataplane.supervisor.support import TINY_MODEL
    from tests.support.processes import emulator_process

    served_model.engine_model_id = "tiny"
    served_model.save()
    deployment = served_model.deployments.get()
    deployment.actuator_kind = ActuatorKind.KUBERNETES
    deployment.actuator_config = validate_actuator_config(
        ActuatorKind.KUBERNETES,
        {
            "namespace": "inference",
            "name": "llama",
            "cluster": "local",
            "pod_selector": "app=llama",
        },
    )
    deployment.current_replicas = 2
    deployment.save()
    config = {"models": [TINY_MODEL]}
    with (
        emulator_process(config, tmp_path) as url_a,
        emulator_process(config, tmp_path) as url_b,
        emulator_process(config, tmp_path) as url_c,
    ):
        port = {url: int(url.rsplit(":", 1)[1]) for url in (url_a, url_b, url_c)}
        k8s_api.add_pod(
            "inference", "llama-a", "127.0.0.1", {"app": "llama"}, http_port=port[url_a]
        )
        k8s_api.add_pod(
            "inference", "llama-b", "127.0.0.1", {"app": "llama"}, http_port=port[url_b]
        )
        assert probe_round().probed == 2
        hung = _pid_listening_on(port[url_a])
        os.kill(hung, signal.SIGSTOP)
        try:
            for _ in range(3):
                probe_round()
            incident = Incident.objects.get()
            assert incident.replica.key == "pod:llama-a"
            assert k8s_api.deleted_pods() == ["llama-a"]
            # The pod is gone from the API: the replica is gone, the incident still open.
            probe_round()
            assert Replica.objects.get(key="pod:llama-a").state == Replica.State.GONE
            assert Incident.objects.get().ended_at is None
            # Its ReplicaSet's new pod comes up and serves: the incident closes, replaced.
            k8s_api.add_pod(
                "inference", "llama-c", "127.0.0.1", {"app": "llama"}, http_port=port[url_c]
            )
            probe_round()
        finally:
            os.kill(hung, signal.SIGCONT)
    incident = Incident.objects.get()
    assert incident.ended_at is not None and incident.ready_at == incident.ended_at
    assert list(incident.steps.values_list("step", flat=True)) == [
        "first_failure",
        "detected",
        "restart_requested",
        "replaced",
    ]
    assert incident.steps.get(step="replaced").detail == "pod:llama-c serves in its place"
    assert set(Replica.objects.values_list("key", "state")) == {
        ("pod:llama-a", "gone"),
        ("pod:llama-b", "healthy"),
        ("pod:llama-c", "healthy"),
    }


def _pid_listening_on(port: int) -> int:
    """The emulator process serving on a port (from /proc/net/tcp and the fds of processes)."""
    import subprocess

    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


def test_wrong_output_is_unhealthy_even_though_it_answers_fast(process_deployment, fast_probes):
    probe_round()  # the known-good fingerprint
    port = http_port_of(process_deployment, 0)
    fault = {"mode": "wrong_output"}
    assert httpx.post(f"http://127.0.0.1:{port}/emulator/faults", json=fault).status_code == 200
    for _ in range(3):
        probe_round()
    incident = Incident.objects.get()
    assert (incident.replica.key, incident.cause) == ("process:0", "wrong_output")
    assert "known good" in incident.detail
    wrong = ProbeResult.objects.filter(outcome="wrong_output")
    assert wrong.count() == 3
    # Fast answers, all of them: it is the content that is wrong.
    assert max(wrong.values_list("latency_ms", flat=True)) < 500
    # The restart brings up a clean engine (faults set by command die with the process).
    wait_until(
        lambda: probe_round() and Incident.objects.get().ended_at is not None,
        timeout_seconds=20,
        what="the restarted replica to answer as known good",
    )
    assert Replica.objects.get(key="process:0").state == Replica.State.HEALTHY


def http_port_of(deployment, index: int) -> int:
    return deployment.actuator_config["base_port"] + index


@pytest.mark.parametrize("priority_scheduling", [False, True])
def test_probes_send_priority_only_to_deployments_with_priority_scheduling(
    sellable, served_model, tmp_path, fast_probes, priority_scheduling
):
    from tests.dataplane.supervisor.support import TINY_MODEL
    from tests.support.processes import emulator_process

    served_model.engine_model_id = "tiny"
    served_model.save()
    deployment = served_model.deployments.get()
    deployment.priority_scheduling = priority_scheduling
    deployment.current_replicas = 1
    # An engine started as vLLM starts by default: fcfs, which refuses a non-zero priority.
    with emulator_process({"models": [TINY_MODEL]}, tmp_path) as url:
        deployment.endpoint_url = url
        deployment.save()
        result = probe_round()

    (probe,) = ProbeResult.objects.filter(replica__deployment=deployment)
    if priority_scheduling:
        # The deployment says its engine has priority scheduling, and it has not: vLLM's 400
        # to the priority. A wrong setting, not a sick engine: it is probed again as fcfs,
        # stays healthy (no restart loop) and the probe says what to fix.
        assert (result.probed, result.failed, probe.outcome) == (1, 0, "ok")
        assert "--scheduling-policy priority" in probe.detail
        assert "priority_scheduling is on" in probe.detail
        assert Replica.objects.get(deployment=deployment).state == Replica.State.HEALTHY
    else:
        assert (result.probed, result.failed, probe.outcome) == (1, 0, "ok")
