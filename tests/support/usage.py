"""Usage for tests that need traffic behind a price: events posted through the real ingestion
path (POST /api/v1/usage/events) by a platform key, as a gateway posts them."""

import uuid
from datetime import timedelta

from django.utils import timezone

from tests.conftest import SIMPLE_WEIGHTS, make_cost_model

USAGE = "/api/v1/usage/events"


def scaled(factor: float, **per_feature: float) -> dict:
    """SIMPLE_WEIGHTS × factor, with some features scaled again by their own factor."""
    return {
        name: weight * factor * per_feature.get(name, 1.0)
        for name, weight in SIMPLE_WEIGHTS.items()
    }


def replica_seconds(weights: dict, input_tokens: int, output_tokens: int) -> float:
    """The plain α/β/γ weights by hand: what the currency's code must agree with."""
    return (
        weights["input_tokens"] * input_tokens
        + weights["output_tokens"] * output_tokens
        + weights["request"]
    )


def gateway_client(make_key, key_client, *, scopes=("read", "usage:write")):
    """A platform key that reports usage for any customer (with `scopes`)."""
    _, plaintext = make_key(service_name="gateway", scopes=list(scopes))
    return key_client(plaintext)


def post_usage(
    client,
    customer: str,
    *,
    count: int,
    input_tokens: int,
    output_tokens: int,
    outcome: str = "completed",
    model: str = "llama-8b",
) -> list[str]:
    """`count` requests of one shape that finished two minutes ago; their event ids."""
    finished = timezone.now() - timedelta(minutes=2)
    events = [
        {
            "event_id": uuid.uuid4().hex,
            "customer": customer,
            "model": model,
            "started_at": (finished - timedelta(seconds=2)).isoformat(),
            "finished_at": finished.isoformat(),
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "outcome": outcome,
        }
        for _ in range(count)
    ]
    response = client.post(USAGE, {"events": events}, format="json")
    assert response.status_code == 200, response.json()
    return [event["event_id"] for event in events]


def last_week_of_traffic(gateway, served_model, gpu_type):
    """v1 (SIMPLE_WEIGHTS) active, then acme's long answers (10 × 1000 in / 100 out), globex's
    long prompts (10 × 4000 / 20) and one refused request of acme's; returns v1."""
    v1 = make_cost_model(served_model, gpu_type)
    assert v1.status == "active"
    post_usage(gateway, "acme", count=10, input_tokens=1000, output_tokens=100)
    post_usage(gateway, "globex", count=10, input_tokens=4000, output_tokens=20)
    # A refused request cost nothing, so it is no part of what a new version would reprice.
    post_usage(gateway, "acme", count=1, input_tokens=2000, output_tokens=0, outcome="refused")
    return v1


def store_events(events: list[dict]) -> None:
    """Usage events written straight to their table, for reads over many of them (100,000 in
    about a second): COPY on PostgreSQL, bulk_create on SQLite. Each dict names at least
    event_id, customer_id, served_model_id, cost_model_id and finished_at; the rest defaults to
    a completed best-effort request of 1 MU, not yet rolled up."""
    from django.db import connection

    from capacity.metering.events import minute_of
    from capacity.metering.ingestion import COLUMNS
    from capacity.models import UsageEvent
    from core.db import copy_upsert

    def full(event: dict) -> dict:
        row = _defaults(event)
        # The stored split, as ingestion makes it when the event does not say: all of a
        # guaranteed event's MU is guaranteed, all of any other's best-effort.
        guaranteed = row["admission_class"] == "guaranteed"
        row.setdefault("guaranteed_mu", row["mu"] if guaranteed else 0.0)
        row.setdefault("best_effort_mu", 0.0 if guaranteed else row["mu"])
        return row

    def _defaults(event: dict) -> dict:
        finished = event["finished_at"]
        return {
            "deployment_id": None,
            "replica": "",
            "started_at": finished - timedelta(seconds=1),
            "minute": minute_of(finished),
            "input_tokens": 100,
            "cached_input_tokens": 0,
            "output_tokens": 10,
            "images": 0,
            "outcome": "completed",
            "admission_class": "best_effort",
            "verification": "recorded",
            "self_reported": False,
            "api_key_prefix": "",
            "ttft_ms": None,
            "held_ms": None,
            "streamed": None,
            "prompts": None,
            "sequences": None,
            "mu": 1.0,
            "estimated_mu": None,
            "prompt_bytes": None,
            "ingested_at": finished,
            "rolled_up": False,
            **event,
        }

    if connection.vendor == "postgresql":
        rows = [tuple(map(full(event).__getitem__, COLUMNS)) for event in events]
        copy_upsert(table=UsageEvent._meta.db_table, columns=COLUMNS, rows=rows)
    else:
        UsageEvent.objects.bulk_create(
            [UsageEvent(**full(event)) for event in events], batch_size=2000
        )


def generate_events(
    *,
    customer,
    served_model,
    cost_model,
    count: int,
    start,
    per_second: int = 10,
    every: int = 1,
    prefix: str = "e-",
) -> None:
    """`count` usage events made by PostgreSQL itself (generate_series: 100,000 in well under
    a second, with no row passing through Python): event ids prefix + n, `per_second` of them
    finishing at each second from `start`, keeping only every `every`-th n; event n used
    1 + n mod 7 MU."""
    from django.db import connection

    sql = """
        INSERT INTO capacity_usageevent (
            event_id, customer_id, served_model_id, replica, started_at, finished_at, minute,
            input_tokens, cached_input_tokens, output_tokens, images, outcome,
            admission_class, verification, self_reported, mu, guaranteed_mu, best_effort_mu,
            cost_model_id, ingested_at, rolled_up)
        SELECT %(prefix)s || n, %(customer)s, %(model)s, '', t - interval '1 second', t,
               date_trunc('minute', t), 100, 0, 10, 0, 'completed', 'best_effort',
               'recorded', false, 1 + n %% 7, 0, 1 + n %% 7, %(cost_model)s, t, false
        FROM generate_series(0, %(count)s - 1) AS n,
             LATERAL (SELECT %(start)s + (n / %(per_second)s) * interval '1 second' AS t) AS at
        WHERE n %% %(every)s = 0
    """
    with connection.cursor() as cursor:
        cursor.execute(
            sql,
            {
                "prefix": prefix,
                "customer": customer.pk,
                "model": served_model.pk,
                "cost_model": cost_model.pk,
                "count": count,
                "start": start,
                "per_second": per_second,
                "every": every,
            },
        )
        # What autovacuum does once rows like these are committed (inside the test's
        # transaction it never sees them): the planner reads them with real statistics.
        cursor.execute("ANALYZE capacity_usageevent")
