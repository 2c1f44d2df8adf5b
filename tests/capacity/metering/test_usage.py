import json
import threading
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.utils import timezone

from capacity.metering.rollups import direct_aggregation, usage_rollup
from capacity.models import UsageEvent, UsageMinute
from capacity.pricing.features import mu_of, replica_seconds_of
from tests.support.servers import gunicorn_server

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
URL = "/api/v1/usage/events"


def event(**overrides) -> dict:
    finished = timezone.now() - timedelta(minutes=2)
    body = {
        "event_id": uuid.uuid4().hex,
        "model": "llama-8b",
        "started_at": (finished - timedelta(seconds=3)).isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": 1000,
        "cached_input_tokens": 0,
        "output_tokens": 100,
        "images": 0,
        "outcome": "completed",
        "admission_class": "guaranteed",
        "ttft_ms": 120.5,
    }
    return body | overrides


@pytest.fixture
def usage_client(acme, make_key, key_client):
    """A customer's own gateway: a planner let acme report its own usage."""
    acme.may_report_own_usage = True
    acme.save()
    _, plaintext = make_key(customer=acme, scopes=["read", "usage:write"])
    return key_client(plaintext)


@pytest.fixture
def gateway(make_key, key_client):
    _, plaintext = make_key(service_name="gateway", scopes=["read", "usage:write"])
    return key_client(plaintext)


def test_events_are_priced_with_the_active_cost_model_and_its_version_is_kept(
    usage_client, sellable
):
    response = usage_client.post(URL, {"events": [event(event_id="e1")]}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["accepted"] == ["e1"]
    stored = UsageEvent.objects.get(event_id="e1")
    # 1000 × 1 ms + 100 × 20 ms + 50 ms = 3.05 replica-s = 3.05 × 100 / 60 MU.
    assert stored.mu == pytest.approx(3.05 * 100 / 60)
    assert stored.cost_model == sellable
    assert stored.customer.slug == "acme"


def test_duplicates_within_and_across_batches_are_reported_not_counted(usage_client, sellable):
    first = usage_client.post(URL, {"events": [event(event_id="a"), event(event_id="a")]},
                              format="json").json()  # fmt: skip
    assert (first["accepted"], first["duplicates"]) == (["a"], ["a"])
    second = usage_client.post(URL, {"events": [event(event_id="a"), event(event_id="b")]},
                               format="json").json()  # fmt: skip
    assert (second["accepted"], second["duplicates"]) == (["b"], ["a"])
    assert UsageEvent.objects.count() == 2


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"input_tokens": "12"}, "input_tokens"),
        ({"input_tokens": -1}, "input_tokens"),
        ({"output_tokens": 1.5}, "output_tokens"),
        ({"model": "ghost"}, "unknown model 'ghost'"),
        ({"outcome": "maybe"}, "outcome"),
        ({"admission_class": 3}, "admission_class"),
        ({"started_at": "not a time"}, "started_at"),
        ({"finished_at": "2026-11-01T00:00:00"}, "finished_at"),  # no time zone
        ({"ttft_ms": -3}, "ttft_ms"),
        ({"cached_input_tokens": 5000}, "cached_input_tokens exceeds input_tokens"),
        ({"surprise": 1}, "surprise: is not a field"),
        ({"event_id": ""}, "event_id"),
        ({"deployment": "nowhere"}, "unknown deployment 'nowhere'"),
        ({"customer": "globex"}, "only that customer's usage"),
    ],
)
def test_each_bad_field_is_rejected_by_index_and_the_valid_events_are_kept(
    usage_client, sellable, globex, overrides, reason
):
    batch = [event(event_id="good-1"), event(**({"event_id": "bad"} | overrides)),
             event(event_id="good-2")]  # fmt: skip
    response = usage_client.post(URL, {"events": batch}, format="json")
    assert response.status_code == 207, response.json()
    body = response.json()
    assert body["accepted"] == ["good-1", "good-2"]
    assert [item["index"] for item in body["rejected"]] == [1]
    assert any(reason in line for line in body["rejected"][0]["reasons"]), body["rejected"]
    assert set(UsageEvent.objects.values_list("event_id", flat=True)) == {"good-1", "good-2"}


def post_between_two_good_events(client, **bad) -> dict:
    """Post [good, bad, good]; the good ones must be stored, the bad one rejected by index."""
    batch = [event(event_id="good-1"), event(**({"event_id": "bad"} | bad)),
             event(event_id="good-2")]  # fmt: skip
    response = client.post(URL, {"events": batch}, format="json")
    assert response.status_code == 207, response.json()
    body = response.json()
    assert body["accepted"] == ["good-1", "good-2"]
    assert [item["index"] for item in body["rejected"]] == [1]
    assert set(UsageEvent.objects.values_list("event_id", flat=True)) == {"good-1", "good-2"}
    return body["rejected"][0]


def test_an_event_with_more_tokens_than_the_models_context_is_rejected_by_index(
    usage_client, sellable, served_model
):
    assert served_model.context_length_tokens == 8192
    rejected = post_between_two_good_events(
        usage_client, input_tokens=2 * 10**9, output_tokens=2 * 10**9
    )
    assert rejected["reasons"] == ["input_tokens: exceeds the model's context (8192 tokens)"]
    UsageEvent.objects.all().delete()
    rejected = post_between_two_good_events(usage_client, input_tokens=8000, output_tokens=193)
    assert rejected["reasons"][0].startswith("output_tokens: input_tokens + output_tokens = 8193")


def test_an_event_filling_the_context_exactly_is_accepted(usage_client, sellable):
    response = usage_client.post(
        URL, {"events": [event(input_tokens=8000, output_tokens=192)]}, format="json"
    )
    assert response.status_code == 200, response.json()


def test_a_ttft_of_1e308_ms_is_rejected_by_index(usage_client, sellable):
    rejected = post_between_two_good_events(usage_client, ttft_ms=1e308)
    assert rejected["reasons"][0].startswith("ttft_ms:")


def test_a_ttft_longer_than_its_own_request_is_rejected_by_index(usage_client, sellable):
    # The event ran 3 s; a first token after 10 s is not a measurement (1 s of clock slack).
    rejected = post_between_two_good_events(usage_client, ttft_ms=10_000)
    assert "ttft_ms (10000) exceeds the request's own duration" in rejected["reasons"][0]
    response = usage_client.post(URL, {"events": [event(ttft_ms=3_900)]}, format="json")
    assert response.status_code == 200, response.json()


@pytest.mark.parametrize(
    ("started_at", "reason"),
    [
        (
            "0001-01-01T00:00:00Z",
            "started_at: more than 24 h before finished_at; no request runs that long",
        ),
        ("0001-01-01T00:00:00+01:00", "started_at: Value error, is out of range"),
    ],
)
def test_an_event_started_in_year_1_is_rejected_by_index(usage_client, sellable, started_at,
                                                          reason):  # fmt: skip
    rejected = post_between_two_good_events(usage_client, started_at=started_at)
    assert rejected["reasons"] == [reason]


def test_an_event_that_ran_just_under_a_day_is_accepted(usage_client, sellable):
    finished = timezone.now() - timedelta(minutes=1)
    long = event(started_at=(finished - timedelta(hours=23, minutes=59)).isoformat(),
                 finished_at=finished.isoformat())  # fmt: skip
    assert usage_client.post(URL, {"events": [long]}, format="json").status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("event_id", "a\x00b"),
        ("event_id", "line\nbreak"),
        ("event_id", "zero\u200bwidth"),
        ("customer", "ac\x00me"),
        ("model", "llama-8b\x00"),
        ("deployment", "x\x00"),
    ],
)
def test_control_characters_in_identifiers_are_rejected_by_index(
    usage_client, sellable, field, value
):
    rejected = post_between_two_good_events(usage_client, **{field: value})
    assert rejected["reasons"] == [
        f"{field}: must be printable ASCII (letters, digits, punctuation; spaces only inside)"
    ]


def test_a_batch_with_keys_besides_events_is_a_400_naming_them(usage_client, sellable):
    response = usage_client.post(URL, {"events": [event()], "event": {}}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {
        "event": ['is not a field here; send {"events": [...]}.']
    }
    assert not UsageEvent.objects.exists()


def test_events_too_old_or_too_far_in_the_future_are_rejected(usage_client, sellable):
    now = timezone.now()
    old = event(finished_at=(now - timedelta(days=30)).isoformat(),
                started_at=(now - timedelta(days=30, seconds=1)).isoformat())  # fmt: skip
    future = event(finished_at=(now + timedelta(hours=1)).isoformat(),
                   started_at=now.isoformat())  # fmt: skip
    response = usage_client.post(URL, {"events": [old, future]}, format="json")
    assert response.status_code == 400
    reasons = [item["reasons"][0] for item in response.json()["rejected"]]
    assert "lateness window" in reasons[0]
    assert "in the future" in reasons[1]
    assert not UsageEvent.objects.exists()


def test_a_batch_over_the_limit_is_413_and_stores_nothing(usage_client, sellable):
    batch = [event() for _ in range(5001)]
    response = usage_client.post(URL, {"events": batch}, format="json")
    assert response.status_code == 413
    assert "at most 5000" in response.json()["error"]["message"]
    assert not UsageEvent.objects.exists()


def test_a_50_megabyte_body_is_refused_cleanly(usage_client, sellable):
    huge = b'{"events": [' + b'{"event_id": "' + b"x" * (50 * 1024 * 1024) + b'"}]}'
    response = usage_client.post(URL, data=huge, content_type="application/json")
    assert response.status_code == 413
    assert response.json()["error"]["status"] == response.status_code
    assert not UsageEvent.objects.exists()


def test_a_gateway_names_the_customer_and_must_do_so(gateway, sellable, acme):
    response = gateway.post(URL, {"events": [event(customer="acme"), event()]}, format="json")
    assert response.status_code == 207
    assert "customer: required" in response.json()["rejected"][0]["reasons"][0]
    assert UsageEvent.objects.get().customer == acme


def test_a_key_without_usage_scope_cannot_post(acme_key_client, sellable):
    response = acme_key_client.post(URL, {"events": [event()]}, format="json")
    assert response.status_code == 403


def test_a_refused_request_costs_nothing(usage_client, sellable):
    usage_client.post(URL, {"events": [event(event_id="r", outcome="refused")]}, format="json")
    assert UsageEvent.objects.get(event_id="r").mu == 0


def test_without_an_admission_record_a_refused_event_counts_at_most_the_control_planes_estimate(
    gateway, acme, sellable
):
    """Issue 34, finding 10: one event's self-declared estimate (up to 10^6) scaled a fleet to
    its maximum. Without a record, the demand is at most the control plane's own estimate of
    the event: its 1,000 input tokens, plus the output cap admission estimates with (no completed
    output yet here: none)."""
    own = mu_of(replica_seconds_of(sellable.weights_replica_seconds, input_tokens=1000,
                                   output_tokens=0), 100.0)  # fmt: skip
    batch = [
        event(event_id="modest", customer="acme", outcome="refused", estimated_mu=own / 2),
        event(event_id="forged", customer="acme", outcome="refused", estimated_mu=1e6),
        # A request that ran is priced by what it used; an estimate sent with it is ignored.
        event(event_id="ran", customer="acme", estimated_mu=2.5),
        event(event_id="silent", customer="acme", outcome="refused"),
    ]
    response = gateway.post(URL, {"events": batch}, format="json")

    assert response.status_code == 200, response.json()
    stored = {e.event_id: e for e in UsageEvent.objects.all()}
    assert (stored["modest"].mu, stored["modest"].estimated_mu) == (0, pytest.approx(own / 2))
    assert stored["forged"].estimated_mu == pytest.approx(own)
    assert stored["ran"].estimated_mu is None and stored["ran"].mu > 0
    assert stored["silent"].estimated_mu is None
    usage_rollup()
    (minute,) = UsageMinute.objects.all()
    assert minute.refused_requests == 3
    assert minute.refused_mu == pytest.approx(own * 1.5)


@pytest.mark.parametrize("estimate", [-1, 1e7, "NaN", "3"])
def test_an_out_of_bounds_estimate_is_refused_naming_the_field(gateway, acme, sellable, estimate):
    bad = event(customer="acme", outcome="refused", estimated_mu=estimate)
    response = gateway.post(URL, {"events": [bad]}, format="json")

    assert response.status_code == 400
    assert "estimated_mu" in json.dumps(response.json())
    assert not UsageEvent.objects.exists()


def test_rollups_equal_a_direct_aggregation_after_late_events(usage_client, sellable):
    base = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=30)
    batch = []
    for index in range(300):
        finished = base + timedelta(seconds=index * 3)
        batch.append(
            event(
                event_id=f"ev-{index}",
                finished_at=finished.isoformat(),
                started_at=(finished - timedelta(seconds=1)).isoformat(),
                output_tokens=index % 50,
                admission_class=["guaranteed", "best_effort", "none"][index % 3],
                outcome="refused" if index % 17 == 0 else "completed",
                estimated_mu=index / 10,
            )
        )
    usage_client.post(URL, {"events": batch[:200]}, format="json")
    usage_rollup()
    # Late events land in minutes that were already rolled up.
    usage_client.post(URL, {"events": batch[200:] + batch[:10]}, format="json")
    assert usage_rollup()["events"] == 100
    rollups = {
        (row.customer_id, row.served_model_id, row.minute): row for row in UsageMinute.objects.all()
    }
    direct = direct_aggregation()
    # Every event is in some minute (on SQLite they once matched no minute at all).
    assert sum(r.requests + r.refused_requests for r in rollups.values()) == 300
    assert set(rollups) == set(direct)
    for key, expected in direct.items():
        row = rollups[key]
        assert row.requests == expected["requests"]
        assert row.refused_requests == expected["refused_requests"]
        assert row.output_tokens == expected["output_tokens"]
        assert row.mu == pytest.approx(expected["mu"])
        assert row.best_effort_mu == pytest.approx(expected["best_effort_mu"] or 0)
        assert row.refused_mu == pytest.approx(expected["refused_mu"] or 0)
    assert not UsageEvent.objects.filter(rolled_up=False).exists()


def test_the_migration_rolls_up_again_what_sqlite_stored_with_offsets(usage_client, sellable):
    """capacity.0011 repairs events stored before the fix: datetimes as text with an offset,
    marked rolled up, with no minute written for them."""
    import importlib
    from types import SimpleNamespace

    from django.apps import apps
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("only SQLite stored them wrong")
    base = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    batch = [
        event(event_id=f"old-{i}", finished_at=(base + timedelta(seconds=20 * i)).isoformat(),
              started_at=(base + timedelta(seconds=20 * i - 1)).isoformat())
        for i in range(12)
    ]  # fmt: skip
    usage_client.post(URL, {"events": batch}, format="json")
    expected = direct_aggregation()
    # As the old code left them: Python's default text for aware datetimes (one in another
    # zone), marked rolled up, and no minutes.
    with connection.cursor() as cursor:
        for stored in UsageEvent.objects.all():
            cursor.execute(
                "UPDATE capacity_usageevent SET started_at = %s, finished_at = %s, minute = %s, "
                "ingested_at = %s, rolled_up = 1 WHERE id = %s",
                [
                    stored.started_at.astimezone(timezone.get_fixed_timezone(120)).isoformat(" "),
                    stored.finished_at.isoformat(" "),
                    stored.minute.isoformat(" "),
                    stored.ingested_at.isoformat(" "),
                    stored.pk,
                ],
            )
    UsageMinute.objects.all().delete()
    minutes = {minute for _, _, minute in expected}
    # What the rollup's lookups saw: no event in any of its minutes.
    assert not UsageEvent.objects.filter(minute__in=minutes).exists()

    migration = importlib.import_module("capacity.migrations.0011_sqlite_usage_rolled_up_again")
    migration.forwards(apps, SimpleNamespace(connection=connection))
    assert usage_rollup()["events"] == 12
    rolled = {(r.customer_id, r.served_model_id, r.minute): r for r in UsageMinute.objects.all()}
    assert set(rolled) == set(expected)
    assert sum(r.requests for r in rolled.values()) == 12
    assert UsageEvent.objects.get(event_id="old-0").started_at == base - timedelta(seconds=1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql_only
def test_the_same_ten_thousand_events_posted_three_times_concurrently_count_once(
    sellable, acme, make_key, tmp_path
):
    acme.may_report_own_usage = True
    acme.save()
    _, plaintext = make_key(customer=acme, scopes=["read", "usage:write"])
    base = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=2)
    events = [
        event(
            event_id=f"c-{index}",
            finished_at=(base + timedelta(seconds=index * 0.5)).isoformat(),
            started_at=(base + timedelta(seconds=index * 0.5 - 1)).isoformat(),
            output_tokens=index % 200,
        )
        for index in range(10_000)
    ]
    batches = [events[start : start + 2_500] for start in range(0, 10_000, 2_500)]
    accepted = []

    def post_all(url):
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
            for batch in batches:
                response = client.post(
                    URL,
                    content=json.dumps({"events": batch}),
                    headers={"Authorization": f"Bearer {plaintext}",
                             "Content-Type": "application/json"},
                )  # fmt: skip
                assert response.status_code == 200, response.text[:500]
                accepted.append(response.json()["accepted_count"])

    with gunicorn_server(tmp_path) as url:
        threads = [threading.Thread(target=post_all, args=(url,)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    assert sum(accepted) == 10_000
    assert UsageEvent.objects.count() == 10_000
    usage_rollup()
    first = {(r.minute, r.requests, round(r.mu, 6)) for r in UsageMinute.objects.all()}
    direct = direct_aggregation()
    assert sum(row["requests"] for row in direct.values()) == 10_000
    assert len(first) == len(direct)
    usage_rollup()  # a second pass changes nothing
    assert {(r.minute, r.requests, round(r.mu, 6)) for r in UsageMinute.objects.all()} == first
