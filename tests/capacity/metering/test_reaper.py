"""Exactly one usage event per request (issue 33, item 4): a request whose gateway worker died
holding its event in memory is closed by the reaper, an admitted one as `cancelled` at 0 MU
(its estimate given back to the buckets), a refused one as the refusal it was; never while its
worker lives, never while events wait in the usage spool, never twice."""

import time

import pytest
import redis
from django.conf import settings

from capacity.admission import gate as admission
from capacity.admission.gateways import SPOOL, WORKERS
from capacity.admission.redis_layout import OPEN_REQUESTS_KEY, bucket_key
from capacity.metering.ingestion import usage_ingest
from capacity.metering.reaper import usage_reap
from capacity.models import UsageEvent
from tests.support.admission import set_rates

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]
COST_MU = 5.0


@pytest.fixture
def store(settings, sellable, served_model, acme, globex):
    settings.USAGE_REAP_GRACE_SECONDS = 60
    buckets = admission.buckets()
    set_rates(
        buckets,
        {(acme.pk, served_model.pk): (600.0, 0.0), (globex.pk, served_model.pk): (0.0, 0.0)},
    )
    return buckets


def decide(buckets, customer, served_model, request_id, owner):
    return buckets.admit(
        customer_id=customer.pk,
        model_id=served_model.pk,
        cost_mu=COST_MU,
        request_id=request_id,
        owner=owner,
    )


def later(seconds: float) -> float:
    return time.time() * 1000 + seconds * 1000


def client():
    return redis.Redis.from_url(settings.ADMISSION_REDIS_URL)


def test_a_dead_workers_requests_are_closed_once_each_as_what_they_were(
    store, served_model, acme, globex
):
    rds = client()
    rds.hset(WORKERS, "gdead", str(int(time.time() * 1000)))  # last seen now, then never
    assert decide(store, acme, served_model, "r-admitted", "gdead").admission_class == "guaranteed"
    assert decide(store, globex, served_model, "r-refused", "gdead").admission_class == "refused"
    g_key = bucket_key(acme.pk, served_model.pk, "guaranteed")
    taken_tat = float(rds.get(g_key))

    assert usage_reap(now_ms=later(30))["reaped"] == 0  # within the grace: its event may come
    result = usage_reap(now_ms=later(61))
    assert result["reaped"] == 2, result

    admitted = UsageEvent.objects.get(event_id="r-admitted")
    assert (admitted.outcome, admitted.admission_class, admitted.verification) == (
        "cancelled",
        "guaranteed",
        "reaped",
    )
    assert (admitted.mu, admitted.input_tokens, admitted.output_tokens) == (0.0, 0, 0)
    refused = UsageEvent.objects.get(event_id="r-refused")
    assert (refused.outcome, refused.admission_class, refused.estimated_mu) == (
        "refused",
        "best_effort",
        COST_MU,
    )
    # The admitted request's estimate went back to its guaranteed bucket (settled at 0 MU).
    assert float(rds.get(g_key) or 0) < taken_tat
    assert rds.zcard(OPEN_REQUESTS_KEY) == 0
    assert usage_reap(now_ms=later(120))["reaped"] == 0  # never twice
    assert UsageEvent.objects.count() == 2


def test_a_live_workers_long_request_stays_open_however_long_it_runs(store, served_model, acme):
    rds = client()
    decide(store, acme, served_model, "r-long", "galive")
    rds.hset(WORKERS, "galive", str(int(later(3600))))  # its heartbeat keeps coming
    assert usage_reap(now_ms=later(3600))["reaped"] == 0
    assert rds.zcard(OPEN_REQUESTS_KEY) == 1
    assert not UsageEvent.objects.exists()


def test_a_request_whose_event_came_is_never_reaped(store, served_model, acme):
    decide(store, acme, served_model, "r-done", "gdead")
    finished = time.time()
    result = usage_ingest(
        events=[
            {
                "event_id": "r-done",
                "customer": "acme",
                "model": served_model.name,
                "started_at": _iso(finished - 1),
                "finished_at": _iso(finished),
                "input_tokens": 100,
                "output_tokens": 10,
                "outcome": "completed",
            }
        ],
        customer=None,
        may_name_customer=True,
    )
    assert result.accepted == ["r-done"]
    assert client().zcard(OPEN_REQUESTS_KEY) == 0  # its event settled it
    assert usage_reap(now_ms=later(3600))["reaped"] == 0
    assert UsageEvent.objects.get().verification == "recorded"


def test_nothing_is_reaped_while_usage_waits_in_the_spool(store, served_model, acme):
    rds = client()
    decide(store, acme, served_model, "r-spooled", "gdead")
    rds.xadd(SPOOL, {"events": "[]"})
    assert usage_reap(now_ms=later(3600))["skipped"]
    rds.delete(SPOOL)
    assert usage_reap(now_ms=later(3600))["reaped"] == 1


def test_a_request_admitted_through_the_api_is_reaped_only_after_the_lateness_window(
    store, served_model, acme
):
    decide(store, acme, served_model, "r-api", "")  # no gateway worker behind it
    lateness_s = settings.USAGE_LATENESS_WINDOW_HOURS * 3600
    assert usage_reap(now_ms=later(lateness_s - 120))["reaped"] == 0
    assert usage_reap(now_ms=later(lateness_s + 61))["reaped"] == 1
    assert UsageEvent.objects.get().verification == "reaped"


def _iso(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, tz=UTC).isoformat()
