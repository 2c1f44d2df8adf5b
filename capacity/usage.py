"""Usage metering: idempotent batch ingestion of usage events (DESIGN §2, "Used").

Each event is priced in MU when it arrives, with the model's active reference cost model,
whose id is stored with it so a later re-fit never reprices the past. Event ids are unique in
the database; a batch is inserted with `ON CONFLICT (event_id) DO NOTHING RETURNING`, so a
retried or concurrent duplicate is reported as a duplicate and never counted twice. Invalid
events are reported by index; the valid events of the same batch are stored.
"""

from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from pydantic import ValidationError

from accounts.models import Customer
from benchmarking.fitting import FEATURES, feature_columns
from capacity import metrics
from capacity.admission import reconcile_usage
from capacity.cost_models import active_cost_model
from capacity.models import CostModel, Deployment, ServedModel, UsageEvent
from capacity.usage_schema import UsageEventIn, minute_of, reasons_from
from controlplane.errors import DomainError

MAX_BATCH_EVENTS = 5_000

COLUMNS = (
    "event_id",
    "customer_id",
    "served_model_id",
    "deployment_id",
    "started_at",
    "finished_at",
    "minute",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "images",
    "outcome",
    "admission_class",
    "ttft_ms",
    "mu",
    "cost_model_id",
    "ingested_at",
    "rolled_up",
)


@dataclass
class IngestResult:
    accepted: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "accepted_count": len(self.accepted),
            "duplicate_count": len(self.duplicates),
            "rejected_count": len(self.rejected),
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": self.rejected,
        }


def _mu_per_event(cost_model: CostModel, events: list[UsageEventIn]) -> np.ndarray:
    counts = np.array(
        [
            (e.input_tokens - e.cached_input_tokens, e.cached_input_tokens, e.output_tokens,
             e.images)
            for e in events
        ],
        dtype=float,
    ).reshape(-1, 4)  # fmt: skip
    weights = np.array([cost_model.weights_replica_seconds.get(name, 0.0) for name in FEATURES])
    matrix = feature_columns(
        input_tokens=counts[:, 0],
        cached_input_tokens=counts[:, 1],
        output_tokens=counts[:, 2],
        images=counts[:, 3],
        features=FEATURES,
    )
    return matrix @ weights * cost_model.replica_mu_per_minute / 60.0


def usage_ingest(*, events, customer: Customer | None, may_name_customer: bool) -> IngestResult:
    """Store a batch of usage events.

    `customer` is the caller's own customer (a customer key): its events may omit the
    customer and may not name another. A platform key (`may_name_customer`) names it.
    """
    if not isinstance(events, list):
        raise DomainError("events must be a list of usage events.", field="events")
    if len(events) > MAX_BATCH_EVENTS:
        raise DomainError(
            f"A batch holds at most {MAX_BATCH_EVENTS} events; this one has {len(events)}. "
            "Split it.",
            field="events",
            code="batch_too_large",
            status=413,
        )
    result = IngestResult()
    now = timezone.now()
    oldest = now - timedelta(hours=settings.USAGE_LATENESS_WINDOW_HOURS)
    newest = now + timedelta(seconds=settings.USAGE_MAX_FUTURE_SECONDS)

    def reject(index: int, raw, reasons: list[str]) -> None:
        event_id = raw.get("event_id") if isinstance(raw, dict) else None
        result.rejected.append(
            {"index": index, "event_id": event_id if isinstance(event_id, str) else None,
             "reasons": reasons}
        )  # fmt: skip

    parsed: list[tuple[int, UsageEventIn]] = []
    for index, raw in enumerate(events):
        if not isinstance(raw, dict):
            reject(index, raw, ["an event must be a JSON object"])
            continue
        try:
            parsed.append((index, UsageEventIn.model_validate(raw)))
        except ValidationError as error:
            reject(index, raw, reasons_from(error))

    models = {
        model.name: model
        for model in ServedModel.objects.filter(name__in={event.model for _, event in parsed})
    }
    customer_slugs = {event.customer for _, event in parsed if event.customer}
    customers = {c.slug: c for c in Customer.objects.filter(slug__in=customer_slugs)}
    deployments = {
        d.name: d
        for d in Deployment.objects.filter(
            name__in={event.deployment for _, event in parsed if event.deployment}
        )
    }
    cost_models: dict[int, CostModel | None] = {}

    seen_in_batch: set[str] = set()
    valid: list[tuple[UsageEventIn, Customer, ServedModel, CostModel]] = []
    for index, event in parsed:
        reasons = []
        owner = customer
        if event.customer and customer is not None and event.customer != customer.slug:
            reasons.append("customer: a customer's key reports only that customer's usage")
        elif event.customer and not may_name_customer and customer is None:
            reasons.append("customer: this key may not report usage")
        elif event.customer:
            owner = customers.get(event.customer)
            if owner is None:
                reasons.append(f"customer: no customer with slug '{event.customer}'")
        elif owner is None:
            reasons.append("customer: required with a platform key")
        model = models.get(event.model)
        cost_model = None
        if model is None:
            reasons.append(f"model: unknown model '{event.model}'")
        else:
            if model.pk not in cost_models:
                cost_models[model.pk] = active_cost_model(served_model=model)
            cost_model = cost_models[model.pk]
            if cost_model is None:
                reasons.append(
                    f"model: '{event.model}' has no active cost model yet, so its usage cannot "
                    "be priced; retry the event once one is active"
                )
        if event.deployment:
            deployment = deployments.get(event.deployment)
            if deployment is None:
                reasons.append(f"deployment: unknown deployment '{event.deployment}'")
            elif model is not None and deployment.served_model_id != model.pk:
                reasons.append(f"deployment: '{event.deployment}' does not serve '{event.model}'")
        if event.finished_at > newest:
            reasons.append(
                f"finished_at: more than {settings.USAGE_MAX_FUTURE_SECONDS} s in the future"
            )
        elif event.finished_at < oldest:
            reasons.append(
                f"finished_at: older than the lateness window "
                f"({settings.USAGE_LATENESS_WINDOW_HOURS} h)"
            )
        if reasons:
            reject(index, events[index], reasons)
            continue
        if event.event_id in seen_in_batch:
            result.duplicates.append(event.event_id)
            continue
        seen_in_batch.add(event.event_id)
        valid.append((event, owner, model, cost_model))

    if valid:
        inserted = _insert(valid, deployments=deployments, ingested_at=now)
        for event, *_ in valid:
            (result.accepted if event.event_id in inserted else result.duplicates).append(
                event.event_id
            )
        # Only events stored now settle their admission: a duplicate never settles twice.
        reconcile_usage(
            [(customer_id, model_id, event_id, mu) for event_id, (customer_id, model_id, mu)
             in inserted.items()]
        )  # fmt: skip
    result.rejected.sort(key=lambda item: item["index"])
    metrics.USAGE_EVENTS.labels("accepted").inc(len(result.accepted))
    metrics.USAGE_EVENTS.labels("duplicate").inc(len(result.duplicates))
    metrics.USAGE_EVENTS.labels("rejected").inc(len(result.rejected))
    return result


def _rows(valid, *, deployments, ingested_at):
    by_cost_model: dict[int, list[int]] = {}
    for position, (_, _, _, cost_model) in enumerate(valid):
        by_cost_model.setdefault(cost_model.pk, []).append(position)
    mu = np.zeros(len(valid))
    for positions in by_cost_model.values():
        cost_model = valid[positions[0]][3]
        mu[positions] = _mu_per_event(cost_model, [valid[p][0] for p in positions])
    for position, (event, owner, model, cost_model) in enumerate(valid):
        deployment = deployments.get(event.deployment) if event.deployment else None
        yield (
            event.event_id,
            owner.pk,
            model.pk,
            deployment.pk if deployment else None,
            event.started_at,
            event.finished_at,
            minute_of(event.finished_at),
            event.input_tokens,
            event.cached_input_tokens,
            event.output_tokens,
            event.images,
            event.outcome,
            event.admission_class,
            event.ttft_ms,
            # A refused request never ran: it used nothing.
            0.0 if event.outcome == "refused" else float(mu[position]),
            cost_model.pk,
            ingested_at,
            False,
        )


def _insert(valid, *, deployments, ingested_at) -> dict[str, tuple[int, int, float]]:
    """Store the events; return those stored now (not known before) as event id ->
    (customer id, model id, MU)."""
    rows = list(_rows(valid, deployments=deployments, ingested_at=ingested_at))
    stored = _insert_rows(rows)
    return {row[0]: (row[1], row[2], row[14]) for row in rows if row[0] in stored}


@transaction.atomic
def _insert_rows(rows) -> set[str]:
    table = UsageEvent._meta.db_table
    columns = ", ".join(COLUMNS)
    if connection.vendor == "postgresql":
        # COPY the batch into a per-connection staging table (emptied at commit), then move
        # it over in one statement that skips known event ids and returns the ones it stored.
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE TEMP TABLE IF NOT EXISTS usage_staging ON COMMIT DELETE ROWS AS "  # noqa: S608
                f"SELECT {columns} FROM {table} WITH NO DATA"
            )
            with cursor.cursor.copy(f"COPY usage_staging ({columns}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT {columns} FROM usage_staging "  # noqa: S608
                "ON CONFLICT (event_id) DO NOTHING RETURNING event_id"
            )
            return {row[0] for row in cursor.fetchall()}
    placeholders = ", ".join(["%s"] * len(COLUMNS))
    sql = (
        f"INSERT INTO {table} ({columns}) VALUES ({placeholders}) "  # noqa: S608
        "ON CONFLICT (event_id) DO NOTHING RETURNING event_id"
    )
    inserted = set()
    with connection.cursor() as cursor:
        for row in rows:
            cursor.execute(sql, row)
            inserted.update(r[0] for r in cursor.fetchall())
    return inserted
