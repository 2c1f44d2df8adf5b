from datetime import timedelta

import pytest
from django.utils import timezone

from capacity.models import Reservation, UsageMinute

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


@pytest.fixture
def history(sellable, served_model, acme, globex):
    """Two hours of acme usage: 10 MU in each minute of the first hour, none in the second
    except one 100 MU spike; a 50 MU/min reservation over the second hour."""
    start = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    rows = [
        UsageMinute(customer=acme, served_model=served_model, minute=start + timedelta(minutes=m),
                    requests=5, mu=10.0, guaranteed_mu=6.0, best_effort_mu=4.0,
                    refused_requests=1 if m == 0 else 0)
        for m in range(60)
    ]  # fmt: skip
    spike = start + timedelta(minutes=90)
    rows.append(
        UsageMinute(customer=acme, served_model=served_model, minute=spike, requests=1, mu=100.0)
    )
    rows.append(UsageMinute(customer=globex, served_model=served_model, minute=start, mu=999))
    UsageMinute.objects.bulk_create(rows)
    Reservation.objects.create(customer=acme, served_model=served_model, mu_per_minute=50,
                               starts_at=start + timedelta(hours=1),
                               ends_at=start + timedelta(hours=2), status="expired")  # fmt: skip
    return start


def test_utilisation_per_step_reports_reserved_used_and_refusals(acme_key_client, history):
    start = history
    response = acme_key_client.get(
        "/api/v1/customers/acme/utilisation",
        {"model": "llama-8b", "from": start.isoformat(),
         "to": (start + timedelta(hours=2)).isoformat(), "step": "1h"},
    )  # fmt: skip
    assert response.status_code == 200, response.json()
    first, second = response.json()["steps"]
    assert first["reserved_mu_per_minute"] == 0
    assert first["used_mu_per_minute_mean"] == pytest.approx(10)
    assert first["used_mu_per_minute_peak_minute"] == pytest.approx(10)
    assert first["guaranteed_mu"] == pytest.approx(360)
    assert first["best_effort_mu"] == pytest.approx(240)
    assert first["refused_requests"] == 1
    assert second["reserved_mu_per_minute"] == pytest.approx(50)
    assert second["used_mu_per_minute_mean"] == pytest.approx(100 / 60)
    assert second["used_mu_per_minute_p95_minute"] == 0  # one busy minute in sixty
    assert second["used_mu_per_minute_peak_minute"] == pytest.approx(100)


def test_a_customer_cannot_read_another_customers_utilisation(globex_key_client, history):
    response = globex_key_client.get("/api/v1/customers/acme/utilisation", {"model": "llama-8b"})
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({}, "model"),
        ({"model": "ghost"}, "model"),
        ({"model": "llama-8b", "step": "fortnight"}, "step"),
        ({"model": "llama-8b", "step": "30"}, "step"),
        ({"model": "llama-8b", "from": "yesterday"}, "from"),
        ({"model": "llama-8b", "from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"},
         "to"),
        ({"model": "llama-8b", "step": "1m", "from": "2026-01-01T00:00:00Z",
          "to": "2026-03-01T00:00:00Z"}, "step"),
    ],
)  # fmt: skip
def test_bad_utilisation_queries_are_400_naming_the_parameter(
    acme_key_client, history, params, field
):
    response = acme_key_client.get("/api/v1/customers/acme/utilisation", params)
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"step": "1000000000d"}, "step"),
        ({"step": "401d"}, "step"),
        ({"step": "9" * 5000}, "step"),
        ({"from": "2026-02-30T00:00:00Z"}, "from"),
        ({"to": "2026-01-01T25:00:00Z"}, "to"),
        ({"to": "0001-01-01T00:00:00Z"}, "to"),
        ({"to": "9999-12-31T23:59:59Z"}, "to"),
        ({"from": "0001-01-01T00:00:00+01:00"}, "from"),
        ({"to": "9999-12-31T23:59:59-23:59"}, "to"),
        ({"from": "1969-12-31T23:59:59Z", "to": "1970-01-01T01:00:00Z"}, "from"),
        ({"from": "1971-01-01T00:00:00Z", "to": "2026-01-01T00:00:00Z"}, "from"),  # too long
        ({"model": "llama-8b\x00"}, "model"),
    ],
)
def test_out_of_range_utilisation_queries_are_400_naming_the_parameter_not_500(
    acme_key_client, history, params, field
):
    response = acme_key_client.get(
        "/api/v1/customers/acme/utilisation", {"model": "llama-8b"} | params
    )
    assert response.status_code == 400, response.content[:300]
    assert field in response.json()["error"]["fields"]


def test_the_last_day_of_2999_is_still_answered(acme_key_client, history):
    response = acme_key_client.get(
        "/api/v1/customers/acme/utilisation",
        {"model": "llama-8b", "to": "2999-12-31T23:59:00Z", "step": "400d"},
    )
    assert response.status_code == 200, response.content[:300]
    assert len(response.json()["steps"]) == 1


def test_model_capacity_shows_deployable_hot_sold_and_used(planner_client, sellable, acme,
                                                           served_model):  # fmt: skip
    from capacity.models import Deployment

    Deployment.objects.filter(name="llama-8b-h100").update(current_replicas=2)
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=300,
        starts_at=timezone.now() - timedelta(minutes=1),
        status="active",
    )
    now = timezone.now().replace(second=0, microsecond=0)
    UsageMinute.objects.create(customer=acme, served_model=served_model,
                               minute=now - timedelta(minutes=2), requests=3, mu=25.0)  # fmt: skip
    body = planner_client.get("/api/v1/models/llama-8b/capacity").json()
    assert body["deployable_mu_per_minute"] == pytest.approx(800)
    assert body["hot_mu_per_minute"] == pytest.approx(200)
    assert body["sellable_mu_per_minute"] == pytest.approx(720)
    assert body["sold_mu_per_minute"] == pytest.approx(300)
    assert body["used_mu_per_minute"] == pytest.approx(5)
    assert body["overcommit_ratio"] == pytest.approx(300 / 800)
    assert body["deployments"][0]["mu_per_minute_per_replica"] == pytest.approx(100)


@pytest.mark.postgresql_only
def test_the_sql_and_the_portable_bucketing_agree(sellable, served_model, acme):
    import random

    from capacity.metering.utilisation import _used_per_bucket_python, _used_per_bucket_sql

    rng = random.Random(4)
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(hours=10)
    minutes = sorted(rng.sample(range(600), 400))  # a third of the minutes without usage
    UsageMinute.objects.bulk_create(
        UsageMinute(customer=acme, served_model=served_model,
                    minute=start + timedelta(minutes=m), requests=rng.randint(0, 9),
                    refused_requests=rng.randint(0, 2), mu=rng.random() * 50,
                    guaranteed_mu=rng.random(), best_effort_mu=rng.random())
        for m in minutes
    )  # fmt: skip
    end = start + timedelta(minutes=600)
    for step_minutes in (1, 7, 60, 600):
        sql = _used_per_bucket_sql(acme, served_model, start, end, 600, step_minutes)
        portable = _used_per_bucket_python(acme, served_model, start, end, 600, step_minutes)
        for bucket, expected in portable.items():
            got = sql.get(bucket, {})
            for name in ("mu", "peak", "p95", "requests", "refused"):
                assert got.get(name, 0) == pytest.approx(expected[name]), (step_minutes, name)


def test_customers_do_not_see_fleet_capacity(acme_key_client, sellable):
    assert acme_key_client.get("/api/v1/models/llama-8b/capacity").status_code == 403


def test_engine_load_is_unknown_not_zero_when_prometheus_is_down(planner_client, sellable,
                                                                 settings):  # fmt: skip
    settings.PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens on the discard port
    body = planner_client.get("/api/v1/models/llama-8b/capacity").json()
    assert body["engine_used_mu_per_minute"] is None
    load = body["deployments"][0]["engine_load"]
    assert load["known"] is False
    assert load["mu_per_minute"] is None
    assert "unreachable" in load["reason"]
