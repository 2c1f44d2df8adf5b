"""Issues 15 and 34: no command, secret or reachable host through the API
(docs/design.md#trust), and each actuator secret only to the destination the operator bound
it to.

Each reproduced attack is replayed here and must end in the attacker's favour no more: the
API refuses it with a 400 that names the rule, and a config forced into the database anyway
is flagged and never sent anywhere (a real local listener shows it received nothing).
"""

import importlib
import subprocess

import httpx
import pytest
from django.apps import apps
from django.core.management import call_command
from django.core.management.base import CommandError

from benchmarking import services as benchmark_services
from benchmarking.models import BenchmarkRun
from capacity.actuation.replicas import ReplicaError, restart
from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_endpoint, probe_round
from capacity.models import AllocationDecision, Deployment
from core import outbound
from tests.capacity.allocation.test_allocation_tick import use
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    emulator_command,
    engines,
    http_supervisor,
    supervisor,
)
from tests.support.processes import ROOT
from tests.support.recording_server import RecordingServer

pytestmark = pytest.mark.django_db

DEPLOYMENT = "/api/v1/deployments/llama-8b-h100/"


def error_of(response) -> dict:
    return response.json()["error"]


@pytest.fixture
def fleet(sellable, served_model, acme, globex):
    """One deployment at 1 replica that demand will push to 3: the tick has a target to apply."""
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1, target_utilisation=1.0
    )
    use(globex, served_model, 300)
    return Deployment.objects.get(name="llama-8b-h100")


@pytest.fixture
def attacker():
    """The attacker's listener: every secret that reaches it is a failure of these rules."""
    with RecordingServer() as server:
        yield server


def force(deployment, kind: str, config: dict) -> None:
    """What a row written before these rules (or edited in the database) holds."""
    Deployment.objects.filter(pk=deployment.pk).update(actuator_kind=kind, actuator_config=config)


def latest_decision(deployment) -> AllocationDecision:
    return AllocationDecision.objects.filter(deployment=deployment).first()


# -- SECRET_KEY to an API server of the attacker's choosing (Kubernetes) ------------------------


def test_it_refuses_a_kubernetes_api_server_and_token_env_through_the_api(
    planner_client, fleet, attacker
):
    attack = {
        "actuator_kind": "kubernetes",
        "actuator_config": {
            "namespace": "inference",
            "name": "llama-8b",
            "api_server": attacker.url,
            "token_env": "SECRET_KEY",
        },
    }

    response = planner_client.patch(DEPLOYMENT, attack, format="json")

    assert response.status_code == 400
    error = error_of(response)
    assert set(error["fields"]) == {"actuator_config.api_server", "actuator_config.token_env"}
    assert "KUBERNETES_CLUSTERS" in error["message"]
    fleet.refresh_from_db()
    assert fleet.actuator_kind == "dry_run"


def test_a_cluster_the_operator_did_not_define_is_refused_naming_the_known_ones(
    planner_client, fleet
):
    config = {"namespace": "inference", "name": "llama-8b", "cluster": "attacker"}

    response = planner_client.patch(
        DEPLOYMENT, {"actuator_kind": "kubernetes", "actuator_config": config}, format="json"
    )

    assert response.status_code == 400
    assert error_of(response)["fields"]["actuator_config.cluster"] == [
        "'attacker' is not a cluster profile of the KUBERNETES_CLUSTERS setting "
        "(known: in-cluster)."
    ]


def test_a_kubernetes_config_forced_into_the_database_never_sends_the_secret(fleet, attacker):
    force(
        fleet,
        "kubernetes",
        {"namespace": "inference", "name": "llama-8b", "api_server": attacker.url,
         "token_env": "SECRET_KEY"},
    )  # fmt: skip

    # Before anyone flags it, the actuator itself refuses the stored config.
    allocation_tick()
    before_flagging = latest_decision(fleet)
    call_command("check_actuator_configs")
    fleet.refresh_from_db()
    allocation_tick()
    flagged = latest_decision(fleet)

    assert before_flagging.actuator_ok is False
    assert "api_server: is an operator setting now" in before_flagging.actuator_error
    assert "KUBERNETES_CLUSTERS" in fleet.actuator_config_problem
    # Both fields at fault are named, so one fix clears the flag.
    assert "actuator_config.api_server:" in fleet.actuator_config_problem
    assert "actuator_config.token_env:" in fleet.actuator_config_problem
    assert flagged.actuator_ok is False and flagged.actuator_attempts == 0
    assert flagged.actuator_error.startswith("refused: the stored actuator config breaks")
    assert "actuator_config_refused" in [reason["code"] for reason in flagged.reasons]
    assert attacker.requests == []


# -- DATABASE_URL to a supervisor of the attacker's choosing (process) --------------------------


def test_it_refuses_a_process_token_env_naming_the_control_planes_secret(planner_client, fleet):
    config = {"engine": "vllm", "base_port": 9000, "token_env": "DATABASE_URL"}

    response = planner_client.patch(
        DEPLOYMENT, {"actuator_kind": "process", "actuator_config": config}, format="json"
    )

    assert response.status_code == 400
    error = error_of(response)
    assert error["fields"] == {
        "actuator_config.token_env": [
            "DATABASE_URL holds one of the control plane's own secrets, which no config may name."
        ]
    }


def test_a_token_env_outside_the_operators_names_is_refused_naming_the_setting(
    planner_client, fleet
):
    config = {"engine": "vllm", "base_port": 9000, "token_env": "HOME"}

    response = planner_client.patch(
        DEPLOYMENT, {"actuator_kind": "process", "actuator_config": config}, format="json"
    )

    assert response.status_code == 400
    assert "ACTUATOR_SECRET_ENV_NAMES=MU_ACTUATOR_*" in error_of(response)["message"]


def test_a_process_config_forced_into_the_database_never_sends_the_secret(fleet, attacker):
    force(
        fleet,
        "process",
        {"engine": "vllm", "base_port": 9000, "supervisor_url": attacker.url,
         "token_env": "DATABASE_URL"},
    )  # fmt: skip

    allocation_tick()
    call_command("check_actuator_configs")
    allocation_tick()

    fleet.refresh_from_db()
    assert "DATABASE_URL holds one of the control plane's own secrets" in (
        fleet.actuator_config_problem
    )
    assert latest_decision(fleet).actuator_ok is False
    assert attacker.requests == []


# -- Commands run as the supervisor's user --------------------------------------------------------


def test_it_refuses_a_command_through_the_api(planner_client, fleet):
    config = {"command": ["/bin/sh", "-c", "id > /tmp/owned", "{port}"], "base_port": 9000}

    response = planner_client.patch(
        DEPLOYMENT, {"actuator_kind": "process", "actuator_config": config}, format="json"
    )

    assert response.status_code == 400
    [reason] = error_of(response)["fields"]["actuator_config.command"]
    assert "python -m dataplane.supervisor --engine" in reason


# -- Load, probes and webhooks aimed anywhere -----------------------------------------------------


@pytest.fixture
def suite(db):
    return benchmark_services.suite_create(
        name="quick",
        grid=[[128, 16]],
        slo_ttft_p95_ms=2000,
        slo_tpot_p95_ms=200,
        duration_per_point_seconds=0.5,
        max_concurrency=2,
    )


def test_it_refuses_a_benchmark_run_aimed_outside_the_allow_list(planner_client, suite, fleet):
    body = {"suite": "quick", "deployment": fleet.name, "endpoint_url": "http://10.1.2.3:8000"}

    response = planner_client.post("/api/v1/benchmark-runs/", body, format="json")

    assert response.status_code == 400
    error = error_of(response)
    assert list(error["fields"]) == ["endpoint_url"]
    assert (
        "10.1.2.3 is not in BENCHMARK_ALLOWED_HOSTS=127.0.0.0/8,::1/128,localhost"
        in (error["message"])
    )
    assert not BenchmarkRun.objects.exists()


def test_a_run_forced_into_the_database_with_a_refused_endpoint_sends_no_request(
    suite, fleet, attacker, settings
):
    settings.BENCHMARK_ALLOWED_HOSTS = ["10.0.0.0/8"]
    run = BenchmarkRun.objects.create(
        suite=suite,
        deployment=fleet,
        served_model=fleet.served_model,
        gpu_type=fleet.gpu_pool.gpu_type,
        endpoint_url=attacker.url,
        engine_model_id=fleet.served_model.engine_model_id,
        progress_total=1,
    )

    benchmark_services.run_execute(run_id=run.pk)

    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.FAILED
    assert "127.0.0.1 is not in BENCHMARK_ALLOWED_HOSTS=10.0.0.0/8" in run.error
    assert attacker.requests == []


def test_a_deployments_endpoint_url_must_be_reachable_under_the_allow_list(planner_client, fleet):
    response = planner_client.patch(
        DEPLOYMENT, {"endpoint_url": "http://169.254.169.254/latest/"}, format="json"
    )

    assert response.status_code == 400
    assert list(error_of(response)["fields"]) == ["endpoint_url"]
    assert "link-local or cloud-metadata" in error_of(response)["message"]


def test_a_health_probe_does_not_reach_a_replica_outside_the_allow_list(attacker, settings):
    settings.OUTBOUND_ALLOWED_HOSTS = ["10.0.0.0/8"]

    answer = probe_endpoint(attacker.url, "llama-8b", timeout_seconds=2)

    assert answer.outcome == "error"
    assert "OutboundRefused" in answer.detail and "OUTBOUND_ALLOWED_HOSTS" in answer.detail
    assert attacker.requests == []


def test_it_refuses_a_webhook_aimed_at_the_metadata_service(planner_client, fleet):
    config = {"url": "http://169.254.169.254/latest/meta-data/", "secret_env": "MU_ACTUATOR_HOOK"}

    response = planner_client.patch(
        DEPLOYMENT, {"actuator_kind": "webhook", "actuator_config": config}, format="json"
    )

    assert response.status_code == 400
    assert "OUTBOUND_ALLOWED_HOSTS" in error_of(response)["fields"]["actuator_config.url"][0]


def test_it_refuses_an_unsigned_webhook_unless_the_operator_allows_it(
    planner_client, fleet, attacker, settings
):
    unsigned = {"actuator_kind": "webhook", "actuator_config": {"url": attacker.url}}

    refused = planner_client.patch(DEPLOYMENT, unsigned, format="json")
    settings.ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS = True
    allowed = planner_client.patch(DEPLOYMENT, unsigned, format="json")

    assert refused.status_code == 400
    assert (
        "ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS"
        in (error_of(refused)["fields"]["actuator_config.secret_env"][0])
    )
    assert allowed.status_code == 200


def test_a_redirect_from_a_webhook_is_not_followed(fleet, monkeypatch, settings):
    monkeypatch.setenv("MU_ACTUATOR_HOOK", "hook-secret")
    with (
        RecordingServer(host="127.0.0.2") as elsewhere,
        RecordingServer(status=307, headers={"Location": elsewhere.url}) as hook,
    ):
        settings.ACTUATOR_SECRET_DESTINATIONS = {"MU_ACTUATOR_HOOK": {"webhook": [hook.url]}}
        force(fleet, "webhook", {"url": hook.url, "secret_env": "MU_ACTUATOR_HOOK"})

        allocation_tick()

        assert len(hook.requests) == 1
        assert elsewhere.requests == []
    decision = latest_decision(fleet)
    assert (decision.actuator_ok, decision.actuator_attempts) == (False, 1)
    assert "answered 307" in decision.actuator_error


# -- Stored configs that break the rules ----------------------------------------------------------


def test_the_api_shows_why_a_stored_config_is_refused_and_a_valid_write_clears_it(
    planner_client, fleet
):
    force(fleet, "process", {"command": ["vllm", "{port}"], "base_port": 9000})
    call_command("check_actuator_configs")

    shown = planner_client.get(DEPLOYMENT).json()
    # Read-only: the API cannot clear the flag by saying so.
    planner_client.patch(DEPLOYMENT, {"actuator_config_problem": ""}, format="json")
    still = planner_client.get(DEPLOYMENT).json()
    fixed = planner_client.patch(
        DEPLOYMENT,
        {"actuator_kind": "process", "actuator_config": {"engine": "vllm", "base_port": 9000}},
        format="json",
    )

    assert shown["actuator_config_problem"].startswith("actuator_config.command:")
    assert still["actuator_config_problem"] == shown["actuator_config_problem"]
    assert fixed.status_code == 200
    assert fixed.json()["actuator_config_problem"] == ""


def test_the_admin_shows_a_refused_config(admin_client, fleet):
    force(fleet, "webhook", {"url": "http://127.0.0.1:9/scale"})
    call_command("check_actuator_configs")

    page = admin_client.get(f"/admin/capacity/deployment/{fleet.pk}/change/")

    assert page.status_code == 200
    assert "ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS" in page.content.decode()


def test_check_actuator_configs_flags_and_clears_against_the_current_settings(
    fleet, settings, capsys
):
    force(fleet, "webhook", {"url": "http://127.0.0.1:9/scale", "secret_env": "MU_ACTUATOR_H"})
    settings.ACTUATOR_SECRET_DESTINATIONS = {"MU_ACTUATOR_H": {"webhook": ["127.0.0.1:9"]}}
    settings.OUTBOUND_ALLOWED_HOSTS = ["10.0.0.0/8"]

    call_command("check_actuator_configs")
    flagged = Deployment.objects.get(pk=fleet.pk).actuator_config_problem
    settings.OUTBOUND_ALLOWED_HOSTS = ["127.0.0.1"]
    call_command("check_actuator_configs")
    out = capsys.readouterr().out

    assert "127.0.0.1 is not in OUTBOUND_ALLOWED_HOSTS=10.0.0.0/8" in flagged
    assert f"{fleet.name}: valid again; flag cleared" in out
    assert Deployment.objects.get(pk=fleet.pk).actuator_config_problem == ""
    with pytest.raises(CommandError):
        settings.OUTBOUND_ALLOWED_HOSTS = ["10.0.0.0/8"]
        call_command("check_actuator_configs", "--strict")


def test_the_migration_flags_stored_configs_and_drops_a_no_op_verify_tls(fleet, deployment_pair):
    in_cluster, with_server = deployment_pair
    migration = importlib.import_module(
        "capacity.migrations.0012_deployment_actuator_config_problem"
    )

    migration.flag_configs_that_break_the_rules(apps, None)

    in_cluster.refresh_from_db()
    with_server.refresh_from_db()
    fleet.refresh_from_db()
    # verify_tls was stored by default and applied only with api_server: in-cluster is fine.
    assert in_cluster.actuator_config == {
        "namespace": "inference",
        "name": "a",
        "kind": "Deployment",
    }
    assert in_cluster.actuator_config_problem == ""
    assert "KUBERNETES_CLUSTERS" in with_server.actuator_config_problem
    assert fleet.actuator_config_problem == ""


@pytest.fixture
def deployment_pair(served_model, pool):
    from tests.support.factories import DeploymentFactory

    legacy = {"namespace": "inference", "kind": "Deployment", "verify_tls": True}
    return (
        DeploymentFactory(
            name="legacy-in-cluster",
            served_model=served_model,
            gpu_pool=pool,
            actuator_kind="kubernetes",
            actuator_config=legacy | {"name": "a"},
        ),
        DeploymentFactory(
            name="legacy-api-server",
            served_model=served_model,
            gpu_pool=pool,
            actuator_kind="kubernetes",
            actuator_config=legacy
            | {"name": "b", "api_server": "https://k8s.example:6443", "token_env": "K8S_TOKEN"},
        ),
    )


def seed_demo_at_the_default_ports() -> None:
    call_command(
        "seed_demo", "--emulator-url", "http://127.0.0.1:8101",
        "--supervisor-url", "http://127.0.0.1:8190",
    )  # fmt: skip


def make_run_bindings() -> str:
    """ACTUATOR_SECRET_DESTINATIONS as scripts/run.sh exports it at its default ports: its own
    lines, run by bash."""
    script = (ROOT / "scripts" / "run.sh").read_text()
    start = script.index("printf -v DEMO_SECRET_DESTINATIONS")
    end = script.index("export ACTUATOR_SECRET_DESTINATIONS", start)
    return subprocess.run(
        ["bash", "-c", script[start:end] + 'printf %s "$DEMO_SECRET_DESTINATIONS"'],
        env={"HOST": "127.0.0.1", "SUPERVISOR_PORT": "8190", "EMULATOR_PORT": "8101"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_the_demos_supervisor_and_webhook_are_allowed_with_the_bindings_make_run_sets(db, settings):
    settings.ACTUATOR_SECRET_DESTINATIONS = outbound.parse_secret_destinations(
        make_run_bindings(),
        kubernetes_clusters=settings.KUBERNETES_CLUSTERS,
        secret_env_patterns=settings.ACTUATOR_SECRET_ENV_NAMES,
    )

    seed_demo_at_the_default_ports()

    webhook = Deployment.objects.get(name="llama-8b-l40s")
    assert webhook.actuator_kind == "webhook"
    assert webhook.actuator_config == {
        "url": "http://127.0.0.1:8101/admin/webhook/scale",
        "secret_env": "MU_ACTUATOR_DEMO_WEBHOOK_SECRET",
    }
    assert webhook.actuator_config_problem == ""
    process = Deployment.objects.get(name="llama-8b-h100")
    assert process.actuator_kind == "process"
    assert process.actuator_config == {
        "engine": "llama-3.1-8b", "host": "127.0.0.1", "base_port": 8111,
        "supervisor_url": "http://127.0.0.1:8190", "drain_seconds": 10,
        "token_env": "MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN",
    }  # fmt: skip
    assert process.actuator_config_problem == ""


# -- Issue 34: a secret goes only where the operator bound it --------------------------------------

SUPERVISOR_TOKEN_ENV = "MU_ACTUATOR_SUPERVISOR_TOKEN"
SUPERVISOR_TOKEN = "s3cret-token"  # http_supervisor's


@pytest.fixture
def real_supervisor(http_supervisor, monkeypatch, settings):  # noqa: F811
    """The operator's process supervisor, its token in the environment and bound to it."""
    monkeypatch.setenv(SUPERVISOR_TOKEN_ENV, SUPERVISOR_TOKEN)
    settings.ACTUATOR_SECRET_DESTINATIONS = {
        SUPERVISOR_TOKEN_ENV: {"supervisor": [http_supervisor.url]}
    }
    return http_supervisor


@pytest.fixture
def elsewhere():
    """The attacker's listener on another host the allow-list allows (production allows all of
    10.0.0.0/8; here, all of 127.0.0.0/8)."""
    with RecordingServer(host="127.0.0.2") as server:
        yield server


def process_config(supervisor_url: str, token_env: str = SUPERVISOR_TOKEN_ENV) -> dict:
    return {
        "engine": "emulator",
        "base_port": 9000,
        "supervisor_url": supervisor_url,
        "token_env": token_env,
    }


def opened_by(real, received) -> list[int]:
    """What the real supervisor answers to each Authorization header the listener received."""
    return [
        httpx.get(f"{real.url}/status", headers={"Authorization": header}, timeout=5).status_code
        for request in received
        if (header := request.headers.get("authorization"))
    ]


def test_a_catalog_key_cannot_send_the_supervisors_token_to_a_listener_of_its_choosing(
    catalog_service_client, fleet, real_supervisor, elsewhere
):
    attack = {"actuator_kind": "process", "actuator_config": process_config(elsewhere.url)}

    response = catalog_service_client.patch(DEPLOYMENT, attack, format="json")
    allocation_tick()

    # Before bindings: the listener got "Bearer s3cret-token", which opened the real /status.
    stolen = [r.headers.get("authorization") for r in elsewhere.requests]
    assert (stolen, opened_by(real_supervisor, elsewhere.requests)) == ([], [])
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "secret_not_for_destination"
    assert error["fields"] == {
        "actuator_config.token_env": [
            f"{SUPERVISOR_TOKEN_ENV} may be sent only to the process supervisor at "
            f"{real_supervisor.url} (ACTUATOR_SECRET_DESTINATIONS, an operator setting), "
            f"not to {elsewhere.url}."
        ]
    }
    fleet.refresh_from_db()
    assert fleet.actuator_kind == "dry_run"


def test_a_catalog_key_cannot_create_a_deployment_that_sends_the_token_elsewhere(
    catalog_service_client, fleet, real_supervisor, elsewhere
):
    body = {
        "name": "llama-8b-h100-b",
        "served_model": fleet.served_model.name,
        "gpu_pool": fleet.gpu_pool.name,
        "gpus_per_replica": 1,
        "min_replicas": 1,
        "max_replicas": 2,
        "cold_start_seconds": 90,
        "actuator_kind": "process",
        "actuator_config": process_config(elsewhere.url),
    }

    response = catalog_service_client.post("/api/v1/deployments/", body, format="json")
    allocation_tick()

    assert elsewhere.requests == []
    assert response.status_code == 400
    assert error_of(response)["code"] == "secret_not_for_destination"
    assert list(error_of(response)["fields"]) == ["actuator_config.token_env"]
    assert not Deployment.objects.filter(name="llama-8b-h100-b").exists()


def test_the_supervisors_token_still_reaches_the_supervisor_it_is_bound_to(
    catalog_service_client, fleet, real_supervisor
):
    config = process_config(real_supervisor.url) | {"base_port": 65535, "engine": "sleeper"}

    response = catalog_service_client.patch(
        DEPLOYMENT, {"actuator_kind": "process", "actuator_config": config}, format="json"
    )
    allocation_tick()

    assert response.status_code == 200, response.json()
    # Authenticated: the supervisor itself refuses 3 replicas from port 65535 (400), not the
    # token (401).
    decision = latest_decision(fleet)
    assert decision.actuator_ok is False
    assert "answered 400: base_port" in decision.actuator_error


def test_a_webhook_secret_is_refused_for_a_receiver_it_is_not_bound_to(
    catalog_service_client, fleet, elsewhere, settings, monkeypatch
):
    monkeypatch.setenv("MU_ACTUATOR_HOOK", "hook-secret")
    with RecordingServer() as receiver:
        settings.ACTUATOR_SECRET_DESTINATIONS = {"MU_ACTUATOR_HOOK": {"webhook": [receiver.url]}}
        attack = {"url": f"{elsewhere.url}/scale", "secret_env": "MU_ACTUATOR_HOOK"}
        own = {"url": f"{receiver.url}/scale", "secret_env": "MU_ACTUATOR_HOOK"}

        refused = catalog_service_client.patch(
            DEPLOYMENT, {"actuator_kind": "webhook", "actuator_config": attack}, format="json"
        )
        allowed = catalog_service_client.patch(
            DEPLOYMENT, {"actuator_kind": "webhook", "actuator_config": own}, format="json"
        )
        allocation_tick()

    assert elsewhere.requests == []
    assert refused.status_code == 400
    assert error_of(refused)["code"] == "secret_not_for_destination"
    [reason] = error_of(refused)["fields"]["actuator_config.secret_env"]
    assert f"only to the webhook at {receiver.url}" in reason
    assert f"not to {elsewhere.url}" in reason
    assert allowed.status_code == 200
    [signed] = receiver.requests
    assert signed.path == "/scale" and signed.headers["x-signature-256"].startswith("sha256=")


@pytest.mark.parametrize(
    ("kind", "config", "says"),
    [
        # The supervisor's token as a webhook's signing key, even at the supervisor's origin.
        (
            "webhook",
            lambda real: {
                "url": f"{real.url}/scale",
                "secret_env": SUPERVISOR_TOKEN_ENV,
            },
            "is bound to the process supervisor at {url}",
        ),
        # A cluster profile's token sent to a supervisor.
        (
            "process",
            lambda real: process_config(real.url, "MU_ACTUATOR_K8S_TOKEN"),
            "is the token of cluster profile 'lab' (KUBERNETES_CLUSTERS)",
        ),
    ],
)
def test_a_secret_bound_to_one_kind_of_destination_is_refused_for_another(
    catalog_service_client, fleet, real_supervisor, settings, kind, config, says
):
    settings.KUBERNETES_CLUSTERS = {
        "lab": {"api_server": "https://10.0.0.1:6443", "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }

    response = catalog_service_client.patch(
        DEPLOYMENT,
        {"actuator_kind": kind, "actuator_config": config(real_supervisor)},
        format="json",
    )

    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "secret_not_for_destination"
    [reasons] = error["fields"].values()
    assert says.format(url=real_supervisor.url) in reasons[0]


def test_an_unbound_secret_is_refused_unless_the_operator_allows_unbound_secrets(
    catalog_service_client, fleet, real_supervisor, elsewhere, settings
):
    unbound = {"actuator_kind": "process", "actuator_config": process_config(
        elsewhere.url, "MU_ACTUATOR_UNBOUND")}  # fmt: skip
    bound = {"actuator_kind": "process", "actuator_config": process_config(elsewhere.url)}

    refused = catalog_service_client.patch(DEPLOYMENT, unbound, format="json")
    settings.ACTUATOR_ALLOW_UNBOUND_SECRETS = True
    allowed = catalog_service_client.patch(DEPLOYMENT, unbound, format="json")
    still_refused = catalog_service_client.patch(DEPLOYMENT, bound, format="json")

    assert refused.status_code == 400
    assert error_of(refused)["code"] == "secret_not_for_destination"
    [reason] = error_of(refused)["fields"]["actuator_config.token_env"]
    assert "MU_ACTUATOR_UNBOUND is bound to no destination" in reason
    assert "ACTUATOR_ALLOW_UNBOUND_SECRETS" in reason
    # The old behaviour, chosen by the operator, for secrets bound nowhere; a bound one stays.
    assert allowed.status_code == 200
    assert still_refused.status_code == 400


def test_a_stored_config_naming_a_foreign_secret_is_flagged_and_never_sends_it(
    fleet, real_supervisor, elsewhere, capsys
):
    # Written before bindings existed (or before the operator bound the token elsewhere).
    force(fleet, "process", process_config(elsewhere.url))
    fleet.refresh_from_db()

    # Before anyone flags it, every path that would send the token refuses it itself.
    allocation_tick()
    pushed = latest_decision(fleet)
    probed = probe_round()
    with pytest.raises(ReplicaError) as restarted:
        restart(fleet, "process:0")
    call_command("check_actuator_configs")
    fleet.refresh_from_db()
    allocation_tick()
    flagged = latest_decision(fleet)

    assert elsewhere.requests == []
    assert pushed.actuator_ok is False
    assert "actuator_config.token_env" in pushed.actuator_error
    assert f"not to {elsewhere.url}" in pushed.actuator_error
    assert any(f"not to {elsewhere.url}" in error for error in probed.errors)
    assert f"not to {elsewhere.url}" in str(restarted.value)
    assert fleet.actuator_config_problem.startswith("actuator_config.token_env: ")
    assert f"not to {elsewhere.url}" in fleet.actuator_config_problem
    assert f"{fleet.name} (process): actuator_config.token_env" in capsys.readouterr().out
    assert flagged.actuator_ok is False and flagged.actuator_attempts == 0
    assert "actuator_config_refused" in [reason["code"] for reason in flagged.reasons]


def test_without_bindings_the_demos_secrets_are_flagged_saying_which_setting_binds_them(db):
    seed_demo_at_the_default_ports()

    for name, field, secret in [
        ("llama-8b-l40s", "secret_env", "MU_ACTUATOR_DEMO_WEBHOOK_SECRET"),
        ("llama-8b-h100", "token_env", "MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN"),
    ]:
        problem = Deployment.objects.get(name=name).actuator_config_problem
        assert problem.startswith(f"actuator_config.{field}: {secret} is bound to no destination")
        assert "ACTUATOR_SECRET_DESTINATIONS" in problem
