"""A planner reads the health page in a real browser: replicas, an incident and its steps,
the degradation of a model, and edits its policy through the form."""

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

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
from tests.support.browser import log_in, screenshot
from tests.support.factories import ServedModelFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def health(deployment, served_model):
    now = timezone.now()
    DeploymentFingerprint.objects.create(
        deployment=deployment,
        prompt="Control-plane health probe. Reply with the next words:",
        answer=" The quick brown fox jumps over",
        answer_sha256="e" * 64,
        recorded_at=now - timedelta(days=1),
        recorded_from="process:0",
    )
    Replica.objects.create(
        deployment=deployment,
        key="process:0",
        url="http://127.0.0.1:8101",
        last_probe_at=now,
        last_ok_at=now,
        last_latency_ms=182.0,
    )
    broken = Replica.objects.create(
        deployment=deployment,
        key="process:1",
        url="http://127.0.0.1:8102",
        state=Replica.State.UNHEALTHY,
        consecutive_failures=4,
        last_probe_at=now,
        last_error="timeout: no answer within 5 s",
    )
    detected = now - timedelta(seconds=40)
    incident = Incident.objects.create(
        replica=broken,
        deployment=deployment,
        cause=ProbeOutcome.TIMEOUT,
        detail="no answer within 5 s",
        detected_at=detected,
        restart_requested_at=detected + timedelta(seconds=1.2),
    )
    IncidentStep.objects.bulk_create(
        [
            IncidentStep(
                incident=incident,
                step=IncidentStep.Step.FIRST_FAILURE,
                at=detected - timedelta(seconds=10),
                detail="timeout: no answer within 5 s",
            ),
            IncidentStep(
                incident=incident,
                step=IncidentStep.Step.DETECTED,
                at=detected,
                detail="3 failed probes in a row",
            ),
            IncidentStep(
                incident=incident,
                step=IncidentStep.Step.RESTART_REQUESTED,
                at=detected + timedelta(seconds=1.2),
                detail="process supervisor restarted replica 1",
            ),
        ]
    )
    fallback = ServedModelFactory(
        name="llama-1b", reference_gpu_type=served_model.reference_gpu_type
    )
    DegradationPolicy.objects.create(served_model=served_model, max_tokens_cap=256)
    DegradationState.objects.create(
        served_model=served_model, level=1, healthy_share=0.5, changed_at=now
    )
    DegradationChange.objects.create(
        served_model=served_model,
        at=now,
        from_level=0,
        to_level=1,
        healthy_share=0.5,
        reason="healthy capacity 50% has been below 75% for 60 s: best-effort traffic is refused",
    )
    return incident, fallback


def test_a_planner_reads_health_and_edits_a_policy(site, page, planner_user, health):
    incident, _ = health
    log_in(page, site, "pat")
    page.goto(site + "/planner/health/")
    expect(page.get_by_role("heading", name="Health", exact=True)).to_be_visible()
    expect(page.get_by_text("Unhealthy (being replaced)").first).to_be_visible()
    expect(page.get_by_text("best-effort traffic is refused").first).to_be_visible()
    screenshot(page, "health")

    page.get_by_role("link", name=f"#{incident.pk}").click()
    expect(page.get_by_role("heading", name=f"Incident #{incident.pk}")).to_be_visible()
    expect(page.get_by_role("cell", name="Restart requested", exact=True)).to_be_visible()
    expect(page.get_by_text("+1.2 s").first).to_be_visible()
    screenshot(page, "incident")

    page.get_by_role("link", name="← Health").click()
    page.get_by_role("link", name="Edit policy").click()
    # Recovering below the degrade threshold is refused on the field.
    page.get_by_label("Recover at (healthy share)").fill("0.5")
    page.get_by_role("button", name="Save policy").click()
    expect(page.get_by_text("must be at least degrade_below")).to_be_visible()
    screenshot(page, "policy-error")
    page.get_by_label("Recover at (healthy share)").fill("0.95")
    page.get_by_label("Level 3: fallback model").select_option(label="llama-1b")
    page.get_by_role("button", name="Save policy").click()
    expect(page.get_by_text("Degradation policy of llama-8b saved.")).to_be_visible()
    expect(page.get_by_text("fallback llama-1b")).to_be_visible()
    screenshot(page, "policy-saved")

    page.get_by_role("button", name="Reset fingerprint of llama-8b-h100").click()
    expect(page.get_by_text("Fingerprint of llama-8b-h100 reset")).to_be_visible()
    assert not DeploymentFingerprint.objects.exists()
