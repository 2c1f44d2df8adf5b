"""Health pages: empty states, replicas and fingerprints, incidents with their timings and
steps, degradation state / policy / changes, the policy form, and no N+1."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

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
from tests.support.factories import DeploymentFactory, ServedModelFactory

pytestmark = pytest.mark.django_db

URL = "/planner/health/"


def queries(client, path):
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content[:300]
    return len(captured), response


def incident_with_steps(deployment, key, *, detected_at, restart_after=None, ready_after=None):
    """An incident as capacity.health.probes writes it: first failure 10 s before detection."""
    replica = Replica.objects.create(
        deployment=deployment,
        key=key,
        url=f"http://10.0.0.1:{8000 + len(key)}",
        state=Replica.State.HEALTHY if ready_after is not None else Replica.State.UNHEALTHY,
        consecutive_failures=0 if ready_after is not None else 3,
        last_probe_at=detected_at,
        last_latency_ms=1234.0,
        last_error="" if ready_after is not None else "timeout: no answer within 5 s",
    )
    incident = Incident.objects.create(
        replica=replica,
        deployment=deployment,
        cause=ProbeOutcome.TIMEOUT,
        detail="no answer within 5 s",
        detected_at=detected_at,
        restart_requested_at=(
            detected_at + timedelta(seconds=restart_after) if restart_after is not None else None
        ),
        ready_at=detected_at + timedelta(seconds=ready_after) if ready_after is not None else None,
        ended_at=detected_at + timedelta(seconds=ready_after) if ready_after is not None else None,
    )
    steps = [
        (IncidentStep.Step.FIRST_FAILURE, -10, "timeout: no answer within 5 s"),
        (IncidentStep.Step.DETECTED, 0, "3 failed probes in a row"),
    ]
    if restart_after is not None:
        steps.append((IncidentStep.Step.RESTART_REQUESTED, restart_after, "pod deleted"))
    if ready_after is not None:
        steps.append((IncidentStep.Step.READY, ready_after, "answered as known good"))
    IncidentStep.objects.bulk_create(
        [
            IncidentStep(
                incident=incident, step=step, at=detected_at + timedelta(seconds=s), detail=d
            )
            for step, s, d in steps
        ]
    )
    return incident


def test_the_health_page_with_an_empty_database(planner_client):
    response = planner_client.get(URL)
    assert response.status_code == 200
    assert b"No deployments." in response.content
    assert b"No served models." in response.content
    assert b"No level changes yet." in response.content
    # The nav shows the section, highlighted.
    assert b'class="current">Health</a>' in response.content


def test_deployments_without_probes_say_what_to_do_next(planner_client, deployment):
    content = planner_client.get(URL).content.decode()
    assert "No replicas probed yet." in content
    assert "HEALTH_PROBE_INTERVAL_SECONDS" in content and "<code>health</code>" in content
    assert "endpoint_url" in content
    assert "No fingerprint yet" in content
    # The model has no policy yet: the page offers one.
    assert "no policy" in content and "Add policy" in content


def test_replicas_fingerprint_and_incidents_with_their_timings(planner_client, deployment):
    now = timezone.now()
    DeploymentFingerprint.objects.create(
        deployment=deployment,
        prompt="p",
        answer=" the quick brown fox",
        answer_sha256="a" * 64,
        recorded_at=now - timedelta(hours=2),
        recorded_from="process:0",
    )
    closed = incident_with_steps(
        deployment,
        "process:0",
        detected_at=now - timedelta(hours=1),
        restart_after=2.5,
        ready_after=95,
    )
    opened = incident_with_steps(
        deployment, "process:1", detected_at=now - timedelta(minutes=1), restart_after=1
    )
    Replica.objects.create(deployment=deployment, key="process:2", url="http://x", state="gone")

    response = planner_client.get(URL)
    content = response.content.decode()
    assert "the quick brown fox" in content and "from process:0" in content
    assert "process:2" in content and "Gone (no longer running)" in content
    assert "Unhealthy (being replaced)" in content
    assert "timeout: no answer within 5 s" in content and "1234 ms" in content
    assert [i.pk for i in response.context["open_incidents"].object_list] == [opened.pk]
    assert [i.pk for i in response.context["recent_incidents"].object_list] == [closed.pk]
    (row,) = response.context["recent_incidents"].object_list
    assert (row.to_restart, row.to_ready) == (2.5, 95.0)
    assert "2.5 s" in content and "95.0 s" in content and "not yet" in content
    assert response.context["counts"] == {"healthy": 1, "unhealthy": 1, "gone": 1}

    detail = planner_client.get(f"/planner/health/incidents/{closed.pk}/")
    assert detail.status_code == 200
    page = detail.content.decode()
    assert [s["label"] for s in detail.context["steps"]] == [
        "First failed probe",
        "Marked unhealthy",
        "Restart requested",
        "Serving again",
    ]
    assert [s["seconds_since_detection"] for s in detail.context["steps"]] == [-10, 0, 2.5, 95]
    assert "-10.0 s" in page and "+2.5 s" in page and "+95.0 s" in page
    assert planner_client.get("/planner/health/incidents/999999/").status_code == 404


def test_a_failed_restart_is_shown(planner_client, deployment):
    incident = incident_with_steps(deployment, "endpoint", detected_at=timezone.now())
    incident.restart_error = "webhook answered 503"
    incident.save()
    content = planner_client.get(URL).content.decode()
    assert "restart: webhook answered 503" in content
    detail = planner_client.get(f"/planner/health/incidents/{incident.pk}/").content.decode()
    assert "The last restart failed." in detail and "webhook answered 503" in detail


def test_reset_fingerprint(planner_client, deployment):
    DeploymentFingerprint.objects.create(
        deployment=deployment,
        prompt="p",
        answer="old answer",
        answer_sha256="b" * 64,
        recorded_at=timezone.now(),
    )
    response = planner_client.post(
        f"/planner/health/deployments/{deployment.name}/reset-fingerprint/", follow=True
    )
    assert response.redirect_chain[-1][0] == URL
    assert not DeploymentFingerprint.objects.exists()
    assert "Fingerprint of llama-8b-h100 reset" in response.content.decode()
    # A second reset says there was nothing to forget; an unknown deployment is a 404.
    again = planner_client.post(
        f"/planner/health/deployments/{deployment.name}/reset-fingerprint/", follow=True
    )
    assert "had no fingerprint" in again.content.decode()
    assert (
        planner_client.get(
            f"/planner/health/deployments/{deployment.name}/reset-fingerprint/"
        ).status_code
        == 405
    )
    assert (
        planner_client.post("/planner/health/deployments/ghost/reset-fingerprint/").status_code
        == 404
    )


def test_degradation_state_policy_and_changes(planner_client, served_model):
    fallback = ServedModelFactory(
        name="llama-1b", reference_gpu_type=served_model.reference_gpu_type
    )
    now = timezone.now()
    DegradationPolicy.objects.create(
        served_model=served_model, max_tokens_cap=64, fallback_model=fallback
    )
    DegradationState.objects.create(
        served_model=served_model, level=2, healthy_share=0.5, changed_at=now, below_since=now
    )
    DegradationChange.objects.create(
        served_model=served_model,
        at=now,
        from_level=1,
        to_level=2,
        healthy_share=0.5,
        reason="healthy capacity 50% has been below 75% for 61 s: max_tokens is capped",
    )
    response = planner_client.get(URL)
    content = response.content.decode()
    rows = {row["model"].name: row for row in response.context["degradation"]}
    assert rows["llama-8b"]["words"].words == [
        "best-effort traffic is refused",
        "max_tokens is capped",
    ]
    assert rows["llama-1b"]["level"] == 0 and rows["llama-1b"]["policy"] is None
    assert "best-effort traffic is refused" in content and "max_tokens is capped" in content
    assert "refused requests are sent to the fallback model" not in content
    assert "50 %" in content and "fallback llama-1b" in content and "cap 64 tokens" in content
    assert "1 → 2" in content and "below 75% for 61 s" in content
    assert response.context["degraded_models"] == 1


def test_the_policy_form_creates_then_edits(planner_client, served_model):
    other = ServedModelFactory(name="llama-1b", reference_gpu_type=served_model.reference_gpu_type)
    url = f"/planner/health/models/{served_model.name}/policy/"
    form = planner_client.get(url)
    assert form.status_code == 200
    # The model cannot fall back to itself: it is not offered.
    choices = [m.name for m in form.context["form"].fields["fallback_model"].queryset]
    assert choices == ["llama-1b"]
    body = {
        "enabled": "on",
        "degrade_below": "0.6",
        "recover_at": "0.8",
        "window_seconds": "30",
        "hysteresis_seconds": "120",
        "max_tokens_cap": "",
        "fallback_model": "",
    }
    response = planner_client.post(url, body, follow=True)
    assert response.redirect_chain[-1][0] == URL + "#degradation"
    assert "Degradation policy of llama-8b created." in response.content.decode()
    policy = DegradationPolicy.objects.get(served_model=served_model)
    assert (policy.degrade_below, policy.recover_at, policy.max_tokens_cap) == (0.6, 0.8, None)

    edit = planner_client.get(url)
    assert edit.context["form"].initial["degrade_below"] == 0.6
    body |= {"max_tokens_cap": "128", "fallback_model": str(other.pk), "enabled": ""}
    response = planner_client.post(url, body, follow=True)
    assert "Degradation policy of llama-8b saved." in response.content.decode()
    policy.refresh_from_db()
    assert (policy.enabled, policy.max_tokens_cap, policy.fallback_model) == (False, 128, other)
    assert DegradationPolicy.objects.count() == 1


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"degrade_below": "0.9", "recover_at": "0.5"}, "recover_at", "at least degrade_below"),
        ({"degrade_below": "0"}, "degrade_below", "above 0 and at most 1"),
        ({"recover_at": "1.5"}, "recover_at", "above 0 and at most 1"),
        ({"degrade_below": "nan"}, "degrade_below", ""),
        ({"window_seconds": "-1"}, "window_seconds", ""),
        ({"max_tokens_cap": "0"}, "max_tokens_cap", ""),
        ({"fallback_model": "SELF"}, "fallback_model", ""),
    ],
)
def test_the_policy_form_shows_field_errors(planner_client, served_model, change, field, words):
    url = f"/planner/health/models/{served_model.name}/policy/"
    body = {
        "enabled": "on",
        "degrade_below": "0.75",
        "recover_at": "0.9",
        "window_seconds": "60",
        "hysteresis_seconds": "180",
    }
    body |= {k: (str(served_model.pk) if v == "SELF" else v) for k, v in change.items()}
    response = planner_client.post(url, body)
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert field in errors, errors
    assert words in " ".join(errors[field])
    assert 'class="errorlist' in response.content.decode()
    assert not DegradationPolicy.objects.exists()


def test_the_policy_page_of_an_unknown_model_is_a_404(planner_client):
    assert planner_client.get("/planner/health/models/ghost/policy/").status_code == 404


def grow(served_model, pool, count, start):
    now = timezone.now()
    for index in range(start, start + count):
        deployment = DeploymentFactory(served_model=served_model, gpu_pool=pool, max_replicas=1)
        DeploymentFingerprint.objects.create(
            deployment=deployment, prompt="p", answer="a", answer_sha256="c" * 64, recorded_at=now
        )
        incident_with_steps(
            deployment, f"pod:a{index}", detected_at=now - timedelta(minutes=index), ready_after=9
        )
        incident_with_steps(deployment, f"pod:b{index}", detected_at=now, restart_after=1)
        model = ServedModelFactory(reference_gpu_type=served_model.reference_gpu_type)
        DegradationPolicy.objects.create(served_model=model, fallback_model=served_model)
        DegradationState.objects.create(served_model=model, level=1, healthy_share=0.4)
        DegradationChange.objects.create(
            served_model=model, at=now, from_level=0, to_level=1, healthy_share=0.4, reason="r"
        )


def test_the_query_count_does_not_grow_with_rows(planner_client, served_model, pool):
    grow(served_model, pool, 2, 0)
    few, _ = queries(planner_client, URL)
    grow(served_model, pool, 6, 2)
    many, response = queries(planner_client, URL)
    assert len(response.context["deployments"].object_list) == 8
    assert many == few
    incident = Incident.objects.first()
    one, _ = queries(planner_client, f"/planner/health/incidents/{incident.pk}/")
    assert one <= 8
