"""The health API: replicas, incidents with steps and timings, degradation per model, the
policy (validated field by field), fingerprint resets, and who may do what."""

from datetime import timedelta

import pytest
from django.utils import timezone

from accounts import scopes as S
from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    DeploymentFingerprint,
    Incident,
    IncidentStep,
    ProbeOutcome,
    Replica,
)
from tests.conftest import _client_for_key
from tests.support.factories import ServedModelFactory

pytestmark = pytest.mark.django_db

READS = ["/api/v1/health/replicas", "/api/v1/health/incidents", "/api/v1/degradation/"]


@pytest.fixture
def fallback(served_model):
    return ServedModelFactory(name="llama-1b", reference_gpu_type=served_model.reference_gpu_type)


@pytest.fixture
def incidents(deployment):
    now = timezone.now()
    healthy = Replica.objects.create(
        deployment=deployment, key="process:0", url="http://h:8001", last_latency_ms=80.0
    )
    broken = Replica.objects.create(
        deployment=deployment,
        key="process:1",
        url="http://h:8002",
        state=Replica.State.UNHEALTHY,
        consecutive_failures=3,
        last_error="wrong_output: answered 'x'",
    )
    closed = Incident.objects.create(
        replica=healthy,
        deployment=deployment,
        cause=ProbeOutcome.ERROR,
        detected_at=now - timedelta(hours=1),
        restart_requested_at=now - timedelta(hours=1) + timedelta(seconds=3),
        ready_at=now - timedelta(hours=1) + timedelta(seconds=40),
        ended_at=now - timedelta(hours=1) + timedelta(seconds=40),
    )
    IncidentStep.objects.bulk_create(
        [
            IncidentStep(
                incident=closed, step="first_failure", at=closed.detected_at - timedelta(seconds=10)
            ),
            IncidentStep(incident=closed, step="detected", at=closed.detected_at),
            IncidentStep(incident=closed, step="restart_requested", at=closed.restart_requested_at),
            IncidentStep(incident=closed, step="ready", at=closed.ready_at),
        ]
    )
    opened = Incident.objects.create(
        replica=broken,
        deployment=deployment,
        cause=ProbeOutcome.WRONG_OUTPUT,
        detected_at=now,
        restart_error="supervisor down",
    )
    IncidentStep.objects.create(incident=opened, step="detected", at=now)
    IncidentStep.objects.create(
        incident=opened, step="restart_failed", at=now + timedelta(seconds=1), detail="down"
    )
    return closed, opened


def test_replicas_and_incidents(planner_client, incidents):
    closed, opened = incidents
    replicas = planner_client.get("/api/v1/health/replicas").json()
    assert replicas["count"] == 2
    assert [(r["key"], r["state"], r["model"]) for r in replicas["results"]] == [
        ("process:0", "healthy", "llama-8b"),
        ("process:1", "unhealthy", "llama-8b"),
    ]
    unhealthy = planner_client.get("/api/v1/health/replicas?state=unhealthy").json()
    assert [r["last_error"] for r in unhealthy["results"]] == ["wrong_output: answered 'x'"]

    body = planner_client.get("/api/v1/health/incidents").json()
    assert [i["id"] for i in body["results"]] == [opened.pk, closed.pk]
    newest, oldest = body["results"]
    assert oldest["seconds_to_restart_requested"] == 3.0
    assert oldest["seconds_to_ready"] == 40.0 and oldest["open"] is False
    assert [(s["step"], s["seconds_since_detection"]) for s in oldest["steps"]] == [
        ("first_failure", -10.0),
        ("detected", 0.0),
        ("restart_requested", 3.0),
        ("ready", 40.0),
    ]
    assert newest["seconds_to_ready"] is None and newest["open"] is True
    assert newest["restart_error"] == "supervisor down"
    assert newest["steps"][-1]["label"] == "Restart failed"

    only_open = planner_client.get("/api/v1/health/incidents?open=true").json()
    assert [i["id"] for i in only_open["results"]] == [opened.pk]
    only_closed = planner_client.get("/api/v1/health/incidents?open=false").json()
    assert [i["id"] for i in only_closed["results"]] == [closed.pk]
    bad = planner_client.get("/api/v1/health/incidents?open=maybe")
    assert bad.status_code == 400 and "open" in bad.json()["error"]["fields"]
    paged = planner_client.get("/api/v1/health/incidents?page_size=1").json()
    assert paged["count"] == 2 and len(paged["results"]) == 1 and paged["next"]


def test_degradation_per_model(planner_client, served_model, fallback):
    now = timezone.now()
    DegradationPolicy.objects.create(served_model=served_model, fallback_model=fallback)
    DegradationState.objects.create(served_model=served_model, level=2, healthy_share=0.25)
    for level in (1, 2):
        DegradationChange.objects.create(
            served_model=served_model,
            at=now + timedelta(seconds=level),
            from_level=level - 1,
            to_level=level,
            healthy_share=0.25,
            reason=f"to {level}",
        )
    body = planner_client.get("/api/v1/degradation/").json()
    rows = {row["model"]: row for row in body["results"]}
    assert rows["llama-1b"]["level"] == 0 and rows["llama-1b"]["policy"] is None
    row = rows["llama-8b"]
    # No max_tokens cap: level 2 is the fallback model.
    assert [a["action"] for a in row["actions"]] == ["refuse_best_effort", "fallback_model"]
    assert row["healthy_share"] == 0.25
    assert row["policy"]["fallback_model"] == "llama-1b"
    assert [c["reason"] for c in row["recent_changes"]] == ["to 2", "to 1"]


def test_put_policy_creates_then_changes(planner_client, served_model, fallback):
    url = f"/api/v1/degradation/{served_model.name}/policy"
    created = planner_client.put(
        url, {"degrade_below": 0.5, "recover_at": 0.8, "max_tokens_cap": 100}, format="json"
    )
    assert created.status_code == 201, created.content
    assert created.json()["window_seconds"] == 60  # the default
    changed = planner_client.put(url, {"fallback_model": "llama-1b"}, format="json")
    assert changed.status_code == 200
    # Fields left out keep their value.
    assert (changed.json()["degrade_below"], changed.json()["max_tokens_cap"]) == (0.5, 100)
    policy = DegradationPolicy.objects.get(served_model=served_model)
    assert policy.fallback_model == fallback
    assert planner_client.get(url).json()["fallback_model"] == "llama-1b"
    assert (
        planner_client.put("/api/v1/degradation/ghost/policy", {}, format="json").status_code == 404
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"degrade_below": 0.9, "recover_at": 0.5}, "recover_at"),
        ({"degrade_below": 0}, "degrade_below"),
        ({"recover_at": 1.01}, "recover_at"),
        ({"degrade_below": "NaN"}, "degrade_below"),
        ({"window_seconds": -1}, "window_seconds"),
        ({"max_tokens_cap": 0}, "max_tokens_cap"),
        ({"fallback_model": "llama-8b"}, "fallback_model"),
        ({"fallback_model": "ghost"}, "fallback_model"),
        ({"enabled": "perhaps"}, "enabled"),
    ],
)
def test_put_policy_refuses_bad_values_naming_the_field(planner_client, served_model, body, field):
    response = planner_client.put(
        f"/api/v1/degradation/{served_model.name}/policy", body, format="json"
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert field in error["fields"], error
    assert not DegradationPolicy.objects.exists()


def test_a_malformed_policy_body_is_a_400(planner_client, served_model):
    response = planner_client.put(
        f"/api/v1/degradation/{served_model.name}/policy",
        data=b'{"degrade_below": ',
        content_type="application/json",
    )
    assert response.status_code == 400


def test_reset_fingerprint(planner_client, deployment):
    url = f"/api/v1/health/deployments/{deployment.name}/reset-fingerprint"
    DeploymentFingerprint.objects.create(
        deployment=deployment,
        prompt="p",
        answer="known good",
        answer_sha256="d" * 64,
        recorded_at=timezone.now(),
    )
    body = planner_client.post(url).json()
    assert body["reset"] is True and body["forgotten_answer"] == "known good"
    assert not DeploymentFingerprint.objects.exists()
    assert planner_client.post(url).json()["reset"] is False
    assert (
        planner_client.post("/api/v1/health/deployments/ghost/reset-fingerprint").status_code == 404
    )


def test_who_may_read_and_change(
    make_key, acme, owner_client, acme_key_client, catalog_service_client, served_model, deployment
):
    _, read_only = make_key(service_name="dashboards", scopes=[S.READ])
    _, no_read = make_key(service_name="gateway", scopes=[S.ADMISSION])
    reader = _client_for_key(read_only)
    policy_url = f"/api/v1/degradation/{served_model.name}/policy"
    reset_url = f"/api/v1/health/deployments/{deployment.name}/reset-fingerprint"
    for path in READS:
        # Fleet-wide data: not for customers' users or keys.
        assert owner_client.get(path).status_code == 403, path
        assert acme_key_client.get(path).status_code == 403, path
        assert _client_for_key(no_read).get(path).status_code == 403, path
        assert reader.get(path).status_code == 200, path
        assert catalog_service_client.get(path).status_code == 200, path
    body = {"degrade_below": 0.5, "recover_at": 0.6}
    # Reading is not changing: a read key, a customer's owner and key may not.
    for client in (reader, owner_client, acme_key_client):
        assert client.put(policy_url, body, format="json").status_code == 403
        assert client.post(reset_url).status_code == 403
    assert catalog_service_client.put(policy_url, body, format="json").status_code == 201
    assert catalog_service_client.post(reset_url).status_code == 200
    assert reader.get(policy_url).status_code == 200
    assert acme_key_client.get(policy_url).status_code == 403


def test_anonymous_callers_are_refused(anon):
    for path in READS:
        assert anon.get(path).status_code in (401, 403)


def test_the_endpoints_are_in_the_schema(planner_client):
    schema = planner_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    paths = schema.json()["paths"]
    for path in (
        "/api/v1/health/replicas",
        "/api/v1/health/incidents",
        "/api/v1/degradation/",
        "/api/v1/degradation/{model_name}/policy",
        "/api/v1/health/deployments/{name}/reset-fingerprint",
    ):
        assert path in paths, path


def test_put_policy_refuses_unknown_fields_naming_them(planner_client, served_model):
    response = planner_client.put(
        f"/api/v1/degradation/{served_model.name}/policy",
        {"degrade_below": 0.5, "recover_at": 0.8, "degrade_at": 0.4, "model": "other"},
        format="json",
    )
    assert response.status_code == 400, response.content
    fields = response.json()["error"]["fields"]
    assert set(fields) == {"degrade_at", "model"}
    assert fields["model"] == ["is read-only: it cannot be set here."]
    assert not DegradationPolicy.objects.exists()
