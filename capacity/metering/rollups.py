"""Per-minute usage rollups (customer × model × minute, and customer × key × model × minute
for the events a recorded key sent), recomputed from raw events.

Each pass takes a slice of events not yet rolled up, recomputes *from all raw events* every
(customer, model, minute) they touch, upserts those rows and marks the slice rolled up.
Recomputing rather than adding makes late events and repeated passes harmless: the rollup
always equals a direct aggregation of the raw events. One pass runs at a time (a PostgreSQL
advisory lock), because two passes over one minute with different snapshots could otherwise
write an older total last.
"""

from django.db import connection, transaction
from django.db.models import Count, Q, Sum

from capacity.models import UsageEvent, UsageKeyMinute, UsageMinute
from core.db import Lock, try_lock_for_transaction

BATCH_EVENTS = 50_000

_PG_PASS = """
WITH picked AS (
    SELECT id, customer_id, served_model_id, minute, api_key_prefix
    FROM capacity_usageevent
    WHERE NOT rolled_up
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), touched AS (
    SELECT DISTINCT customer_id, served_model_id, minute FROM picked
), totals AS (
    SELECT e.customer_id, e.served_model_id, e.minute,
           count(*) FILTER (WHERE e.outcome <> 'refused') AS requests,
           count(*) FILTER (WHERE e.outcome = 'refused') AS refused_requests,
           count(*) FILTER (WHERE e.outcome = 'refused' AND e.admission_class = 'guaranteed')
               AS guaranteed_refused_requests,
           coalesce(sum(e.input_tokens), 0) AS input_tokens,
           coalesce(sum(e.cached_input_tokens), 0) AS cached_input_tokens,
           coalesce(sum(e.output_tokens), 0) AS output_tokens,
           coalesce(sum(e.mu), 0) AS mu,
           coalesce(sum(e.guaranteed_mu), 0) AS guaranteed_mu,
           coalesce(sum(e.best_effort_mu), 0) AS best_effort_mu,
           coalesce(sum(e.mu) FILTER (WHERE e.self_reported), 0) AS self_reported_mu,
           coalesce(sum(e.mu) FILTER (WHERE e.verification IN ('unrecorded', 'contradicted')),
                    0) AS unverified_mu,
           coalesce(sum(e.estimated_mu) FILTER (WHERE e.outcome = 'refused'
                                                AND e.admission_class <> 'none'), 0)
               AS refused_mu,
           coalesce(sum(e.estimated_mu) FILTER (WHERE e.outcome = 'refused'
                                                AND e.admission_class = 'guaranteed'), 0)
               AS guaranteed_refused_mu,
           coalesce(sum(e.prompt_bytes), 0) AS prompt_bytes,
           coalesce(sum(e.input_tokens) FILTER (WHERE e.prompt_bytes IS NOT NULL), 0)
               AS prompt_bytes_input_tokens
    FROM capacity_usageevent e
    JOIN touched t USING (customer_id, served_model_id, minute)
    GROUP BY e.customer_id, e.served_model_id, e.minute
), upserted AS (
    INSERT INTO capacity_usageminute (
        customer_id, served_model_id, minute, requests, refused_requests,
        guaranteed_refused_requests, input_tokens, cached_input_tokens, output_tokens, mu,
        guaranteed_mu, best_effort_mu, self_reported_mu, unverified_mu, refused_mu,
        guaranteed_refused_mu, prompt_bytes, prompt_bytes_input_tokens)
    SELECT customer_id, served_model_id, minute, requests, refused_requests,
           guaranteed_refused_requests, input_tokens, cached_input_tokens, output_tokens, mu,
           guaranteed_mu, best_effort_mu, self_reported_mu, unverified_mu, refused_mu,
           guaranteed_refused_mu, prompt_bytes, prompt_bytes_input_tokens
    FROM totals
    ON CONFLICT (customer_id, served_model_id, minute) DO UPDATE SET
        requests = EXCLUDED.requests,
        refused_requests = EXCLUDED.refused_requests,
        guaranteed_refused_requests = EXCLUDED.guaranteed_refused_requests,
        input_tokens = EXCLUDED.input_tokens,
        cached_input_tokens = EXCLUDED.cached_input_tokens,
        output_tokens = EXCLUDED.output_tokens,
        mu = EXCLUDED.mu,
        guaranteed_mu = EXCLUDED.guaranteed_mu,
        best_effort_mu = EXCLUDED.best_effort_mu,
        self_reported_mu = EXCLUDED.self_reported_mu,
        unverified_mu = EXCLUDED.unverified_mu,
        refused_mu = EXCLUDED.refused_mu,
        guaranteed_refused_mu = EXCLUDED.guaranteed_refused_mu,
        prompt_bytes = EXCLUDED.prompt_bytes,
        prompt_bytes_input_tokens = EXCLUDED.prompt_bytes_input_tokens
    RETURNING 1
), key_touched AS (
    SELECT DISTINCT customer_id, api_key_prefix, served_model_id, minute
    FROM picked WHERE api_key_prefix <> ''
), key_totals AS (
    SELECT e.customer_id, e.api_key_prefix, e.served_model_id, e.minute,
           count(*) FILTER (WHERE e.outcome <> 'refused') AS requests,
           count(*) FILTER (WHERE e.outcome = 'refused') AS refused_requests,
           coalesce(sum(e.mu), 0) AS mu,
           coalesce(sum(e.guaranteed_mu), 0) AS guaranteed_mu,
           coalesce(sum(e.best_effort_mu), 0) AS best_effort_mu
    FROM capacity_usageevent e
    JOIN key_touched t USING (customer_id, api_key_prefix, served_model_id, minute)
    GROUP BY e.customer_id, e.api_key_prefix, e.served_model_id, e.minute
), key_upserted AS (
    INSERT INTO capacity_usagekeyminute (
        customer_id, api_key_prefix, served_model_id, minute, requests, refused_requests, mu,
        guaranteed_mu, best_effort_mu)
    SELECT customer_id, api_key_prefix, served_model_id, minute, requests, refused_requests,
           mu, guaranteed_mu, best_effort_mu
    FROM key_totals
    ON CONFLICT (customer_id, api_key_prefix, served_model_id, minute) DO UPDATE SET
        requests = EXCLUDED.requests,
        refused_requests = EXCLUDED.refused_requests,
        mu = EXCLUDED.mu,
        guaranteed_mu = EXCLUDED.guaranteed_mu,
        best_effort_mu = EXCLUDED.best_effort_mu
    RETURNING 1
)
-- PostgreSQL runs a data-modifying CTE even when nothing reads it.
UPDATE capacity_usageevent SET rolled_up = TRUE
WHERE id IN (SELECT id FROM picked)
"""


_AGGREGATES = {
    "requests": Count("id", filter=~Q(outcome="refused")),
    "refused_requests": Count("id", filter=Q(outcome="refused")),
    "guaranteed_refused_requests": Count(
        "id", filter=Q(outcome="refused", admission_class="guaranteed")
    ),
    "input_tokens": Sum("input_tokens"),
    "cached_input_tokens": Sum("cached_input_tokens"),
    "output_tokens": Sum("output_tokens"),
    "mu": Sum("mu"),
    # An event's MU splits between the two (partial spillover): its own parts, not its class.
    "guaranteed_mu": Sum("guaranteed_mu"),
    "best_effort_mu": Sum("best_effort_mu"),
    "self_reported_mu": Sum("mu", filter=Q(self_reported=True)),
    "unverified_mu": Sum("mu", filter=Q(verification__in=("unrecorded", "contradicted"))),
    # Demand turned away: what the refused requests would have cost (mu is 0 for them); not
    # those the customer's own request limits refused (class "none"), which more capacity
    # would not have admitted.
    "refused_mu": Sum("estimated_mu", filter=Q(outcome="refused") & ~Q(admission_class="none")),
    "guaranteed_refused_mu": Sum(
        "estimated_mu", filter=Q(outcome="refused", admission_class="guaranteed")
    ),
    # The bytes-per-token calibration: prompt bytes beside the engine's own input tokens.
    "prompt_bytes": Sum("prompt_bytes"),
    "prompt_bytes_input_tokens": Sum("input_tokens", filter=Q(prompt_bytes__isnull=False)),
}


# A key's minute: what its requests used (UsageKeyMinute), the columns a key's budget needs.
_KEY_AGGREGATES = {
    name: _AGGREGATES[name]
    for name in ("requests", "refused_requests", "mu", "guaranteed_mu", "best_effort_mu")
}
_KEY_GROUP = ("customer_id", "api_key_prefix", "served_model_id", "minute")


def _aggregate_keys(queryset) -> list[dict]:
    """Rows of (customer_id, api_key_prefix, served_model_id, minute) with the key rollup's
    columns, for the events a recorded key sent."""
    rows = (
        queryset.exclude(api_key_prefix="")
        .values(*_KEY_GROUP)
        .annotate(**{f"total_{name}": expression for name, expression in _KEY_AGGREGATES.items()})
    )
    return [
        {
            **{name: row[name] for name in _KEY_GROUP},
            **{name: row[f"total_{name}"] or 0 for name in _KEY_AGGREGATES},
        }
        for row in rows.order_by()
    ]


def _aggregate(queryset) -> list[dict]:
    """Rows of (customer_id, served_model_id, minute) with the rollup's columns."""
    # Annotations may not reuse the model's field names, hence the prefix.
    rows = queryset.values("customer_id", "served_model_id", "minute").annotate(
        **{f"total_{name}": expression for name, expression in _AGGREGATES.items()}
    )
    return [
        {
            "customer_id": row["customer_id"],
            "served_model_id": row["served_model_id"],
            "minute": row["minute"],
            **{name: row[f"total_{name}"] or 0 for name in _AGGREGATES},
        }
        for row in rows.order_by()
    ]


def _portable_pass(limit: int) -> int:
    """The same pass with the ORM, for SQLite (the `make run` default), which has no
    data-modifying CTEs; SQLite runs one writer at a time, so no lock is needed."""
    picked = list(
        UsageEvent.objects.filter(rolled_up=False)
        .order_by("id")
        .values_list("id", "customer_id", "served_model_id", "minute", "api_key_prefix")[:limit]
    )
    if not picked:
        return 0
    touched = {(c, m, minute) for _, c, m, minute, _ in picked}
    minutes = {minute for _, _, minute in touched}
    events = UsageEvent.objects.filter(
        minute__in=minutes, customer_id__in={c for c, _, _ in touched}
    )
    for row in _aggregate(events):
        if (row["customer_id"], row["served_model_id"], row["minute"]) not in touched:
            continue
        key = {name: row.pop(name) for name in ("customer_id", "served_model_id", "minute")}
        UsageMinute.objects.update_or_create(
            **key, defaults={name: value or 0 for name, value in row.items()}
        )
    keys_touched = {(c, p, m, minute) for _, c, m, minute, p in picked if p}
    if keys_touched:
        for row in _aggregate_keys(
            events.filter(api_key_prefix__in={p for _, p, _, _ in keys_touched})
        ):
            if tuple(row[name] for name in _KEY_GROUP) not in keys_touched:
                continue
            key = {name: row.pop(name) for name in _KEY_GROUP}
            UsageKeyMinute.objects.update_or_create(**key, defaults=row)
    UsageEvent.objects.filter(pk__in=[pk for pk, *_ in picked]).update(rolled_up=True)
    return len(picked)


def usage_rollup(*, limit: int = BATCH_EVENTS, max_passes: int = 100) -> dict:
    """Fold unrolled events into the minute rollups. Returns what it did."""
    events = 0
    for _ in range(max_passes):
        with transaction.atomic():
            if not try_lock_for_transaction(Lock.USAGE_ROLLUP):
                return {"events": events, "skipped": True}
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute(_PG_PASS, {"limit": limit})
                    done = cursor.rowcount
            else:
                done = _portable_pass(limit)
        events += done
        if done < limit:
            break
    return {"events": events, "skipped": False}


def direct_key_aggregation(**filters) -> dict[tuple, dict]:
    """The key rollup computed straight from raw events (for checks and tests): (customer id,
    key prefix, model id, minute) -> columns."""
    return {
        tuple(row.pop(name) for name in _KEY_GROUP): row
        for row in _aggregate_keys(UsageEvent.objects.filter(**filters))
    }


def direct_aggregation(**filters) -> dict[tuple, dict]:
    """The rollup computed straight from raw events (for checks and tests)."""
    return {
        (row.pop("customer_id"), row.pop("served_model_id"), row.pop("minute")): row
        for row in _aggregate(UsageEvent.objects.filter(**filters))
    }
