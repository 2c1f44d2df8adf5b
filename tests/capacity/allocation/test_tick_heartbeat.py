"""A stalled allocation tick is heard of (issue 33, item 1): its age is a gauge, "degraded" in
/readyz's detail (still 200), an alert above every planner page, and one signed alert when the
tick goes stale and one when it is back, sent by the health worker's round (its own queue)."""

import json
from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from capacity.allocation.heartbeat import tick_watch
from capacity.allocation.tick import allocation_tick
from capacity.models import TickHeartbeat
from capacity.tasks import health_probes
from core.models import AuditEntry
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]
SECRET = "alert-secret-for-tests"


@pytest.fixture
def receiver(settings):
    hook = WebhookReceiver(SECRET).start()
    settings.ALERT_WEBHOOK_URL = hook.url
    settings.ALERT_WEBHOOK_SECRET = SECRET
    yield hook
    hook.stop()


def tick_age_metric(client) -> float | None:
    for line in client.get("/metrics").content.decode().splitlines():
        if line.startswith("controlplane_allocation_tick_age_seconds "):
            return float(line.split()[-1])
    return None


def test_a_stale_tick_degrades_readyz_shows_on_the_planner_and_alerts_once_each_way(
    served_model, client, planner_client, receiver, settings, django_capture_on_commit_callbacks
):
    settings.ADMISSION_TICK_STALE_SECONDS = 60
    allocation_tick()
    ticked_at = TickHeartbeat.objects.get().ticked_at
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()["checks"]["allocation_tick"]) == (200, "ok")
    assert tick_age_metric(client) < 60
    assert b"tick-stale" not in planner_client.get("/planner/").content

    with time_machine.travel(ticked_at + timedelta(seconds=90), tick=False):
        ready = client.get("/readyz")
        # Degraded, never unavailable: admission keeps every reservation without the tick.
        assert ready.status_code == 200
        assert ready.json()["status"] == "degraded"
        assert ready.json()["failed"] == ["allocation_tick"]
        assert tick_age_metric(client) == pytest.approx(90, abs=1)
        page = planner_client.get("/planner/").content.decode()
        assert 'data-testid="tick-stale"' in page and "90 s ago" in page
        with django_capture_on_commit_callbacks(execute=True):
            assert tick_watch() == "entered"
        with django_capture_on_commit_callbacks(execute=True):
            assert tick_watch() is None  # once, not every round
    assert len(receiver.received) == 1
    assert receiver.received[0].status == 200  # accepted: the signature checked out
    entered = json.loads(receiver.received[0].raw_body)
    assert (entered["kind"], entered["state"]) == ("allocation_tick_stale", "entered")
    assert entered["tick_age_seconds"] == pytest.approx(90, abs=1)

    with time_machine.travel(ticked_at + timedelta(seconds=120), tick=False):
        allocation_tick()
        with django_capture_on_commit_callbacks(execute=True):
            assert tick_watch() == "left"
    assert [json.loads(r.raw_body)["state"] for r in receiver.received] == ["entered", "left"]
    assert AuditEntry.objects.filter(action="allocation.tick_stale").count() == 1
    assert AuditEntry.objects.filter(action="allocation.tick_recovered").count() == 1


def test_the_health_workers_round_watches_the_tick(
    served_model, receiver, settings, django_capture_on_commit_callbacks
):
    settings.ADMISSION_TICK_STALE_SECONDS = 60
    allocation_tick()
    ticked_at = TickHeartbeat.objects.get().ticked_at
    with (
        time_machine.travel(ticked_at + timedelta(seconds=61), tick=False),
        django_capture_on_commit_callbacks(execute=True),
    ):
        result = health_probes()
    assert result["tick_alert"] == "entered"
    assert json.loads(receiver.received[0].raw_body)["state"] == "entered"


def test_before_the_first_tick_nothing_is_stale(client, planner_client):
    assert client.get("/readyz").json()["checks"]["allocation_tick"] == "unknown"
    assert tick_age_metric(client) is None
    assert tick_watch(now=timezone.now()) is None
    assert b"tick-stale" not in planner_client.get("/planner/").content
