"""Reads of metered usage: the minute rollups for the planner's pages; the raw events as
receipts (`usage_receipts`, the API's `GET /api/v1/usage/events` and the portal); guaranteed
requests against a TTFT objective (`guaranteed_ttft_counts`, the latency SLA of billing). A
model's usage now is `capacity.metering.utilisation.used_now`; a customer's over time,
`capacity.metering.utilisation.customer_utilisation`."""

from dataclasses import dataclass
from datetime import UTC, datetime

from django.db.models import Count, F, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce

from accounts.models import Customer
from capacity.models import (
    AdmissionClass,
    CostModel,
    Outcome,
    Reservation,
    ServedModel,
    UsageEvent,
    UsageMinute,
)


@dataclass(frozen=True)
class CustomerUsageTotals:
    """A customer's usage over a window, every model together."""

    mu: float
    refused_requests: int
    guaranteed_refused_requests: int


NO_USAGE = CustomerUsageTotals(mu=0.0, refused_requests=0, guaranteed_refused_requests=0)


def usage_totals_by_customer(customer_ids, *, since: datetime) -> dict[int, CustomerUsageTotals]:
    """MU used and requests refused (all, and those refused a guaranteed request) per
    customer since `since`, from the minute rollups in one grouped query; a customer without
    usage is absent."""
    rows = (
        UsageMinute.objects.filter(customer_id__in=customer_ids, minute__gte=since)
        .values("customer_id")
        .annotate(
            mu=Sum("mu"),
            refused=Sum("refused_requests"),
            guaranteed_refused=Sum("guaranteed_refused_requests"),
        )
    )
    return {
        row["customer_id"]: CustomerUsageTotals(
            mu=row["mu"] or 0.0,
            refused_requests=row["refused"] or 0,
            guaranteed_refused_requests=row["guaranteed_refused"] or 0,
        )
        for row in rows
    }


def used_model_ids_of_customer(customer) -> set[int]:
    """Ids of the models the customer has metered usage of."""
    return set(
        UsageMinute.objects.filter(customer=customer)
        .values_list("served_model_id", flat=True)
        .distinct()
    )


def usage_events_of_customer_newest_first(customer, *, limit: int) -> QuerySet[UsageEvent]:
    """The customer's newest `limit` usage events (with their model), the newest first: its
    receipts, one per request metered."""
    return (
        UsageEvent.objects.filter(customer=customer)
        .select_related("served_model")
        .order_by("-finished_at", "-id")[:limit]
    )


# --- Receipts: the usage events an invoice is built on, one per request ---------------------

# Newest first; (finished_at, id) is unique, so a page can continue strictly after the last row
# of the one before (keyset paging, index `usage_customer_newest`), whatever the number of events.
RECEIPT_ORDERING = ("-finished_at", "-id")

# An event's guaranteed and best-effort parts, as admission split it and ingestion stored it
# (partial spillover: only the part beyond the guarantee's remainder is best-effort); billing
# prices the same parts, summed by the minute rollups.
_GUARANTEED_MU = F("guaranteed_mu")
_BEST_EFFORT_MU = F("best_effort_mu")

# What one receipt holds; the internal replica and deployment are not the customer's business.
# Names (customer, model, cost-model version) are looked up per page by receipts_of, so the
# page itself reads one table, in the order of its index.
RECEIPT_FIELDS = (
    "id",
    "event_id",
    "customer_id",
    "served_model_id",
    "started_at",
    "finished_at",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "images",
    "outcome",
    "admission_class",
    "verification",
    "self_reported",
    "api_key_prefix",
    "ttft_ms",
    "held_ms",
    "streamed",
    "prompts",
    "sequences",
    "mu",
    "receipt_guaranteed_mu",
    "receipt_best_effort_mu",
    "estimated_mu",
    "cost_model_id",
)


def usage_receipts(
    *,
    customer_ids=None,
    served_model=None,
    finished_from: datetime | None = None,
    finished_before: datetime | None = None,
    outcome: str | None = None,
) -> QuerySet:
    """Usage events as receipt rows (dicts with RECEIPT_FIELDS), newest first; `receipts_of`
    turns a page of them into receipts: each with its MU, its guaranteed and best-effort parts
    and the cost-model version that priced it.

    `customer_ids` limits them to those customers (None: every customer; callers pass the ids
    the principal may see, as a list: one id lets the database read that customer's receipts
    in order from the index). The time range is on `finished_at`, the time a request is billed
    at, from inclusive to before exclusive. The API narrows the same queryset with its
    filters (capacity.api.metering_views.UsageReceiptFilter)."""
    events = UsageEvent.objects.all()
    if customer_ids is not None:
        events = events.filter(customer_id__in=customer_ids)
    if served_model is not None:
        events = events.filter(served_model=served_model)
    if finished_from is not None:
        events = events.filter(finished_at__gte=finished_from)
    if finished_before is not None:
        events = events.filter(finished_at__lt=finished_before)
    if outcome:
        events = events.filter(outcome=outcome)
    return (
        events.annotate(
            receipt_guaranteed_mu=_GUARANTEED_MU, receipt_best_effort_mu=_BEST_EFFORT_MU
        )
        .values(*RECEIPT_FIELDS)
        .order_by(*RECEIPT_ORDERING)
    )


def _instant(value: datetime) -> str:
    """ISO 8601 in UTC with a Z, as the API writes every instant (DRF's encoder), made here
    once for the JSON page and the CSV alike."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def receipts_of(rows: list[dict]) -> list[dict]:
    """A page of receipt rows as the API, the CSV and the portal show them, with the names of
    their customers and models and their cost models' versions (three small lookups)."""
    slugs = dict(
        Customer.objects.filter(pk__in={row["customer_id"] for row in rows}).values_list(
            "pk", "slug"
        )
    )
    names = dict(
        ServedModel.objects.filter(pk__in={row["served_model_id"] for row in rows}).values_list(
            "pk", "name"
        )
    )
    versions = dict(
        CostModel.objects.filter(pk__in={row["cost_model_id"] for row in rows}).values_list(
            "pk", "version"
        )
    )
    return [
        {
            "event_id": row["event_id"],
            "customer": slugs[row["customer_id"]],
            "model": names[row["served_model_id"]],
            "started_at": _instant(row["started_at"]),
            "finished_at": _instant(row["finished_at"]),
            "input_tokens": row["input_tokens"],
            "cached_input_tokens": row["cached_input_tokens"],
            "output_tokens": row["output_tokens"],
            "images": row["images"],
            "outcome": row["outcome"],
            "admission_class": row["admission_class"],
            "verification": row["verification"],
            "self_reported": row["self_reported"],
            "api_key": row["api_key_prefix"] or None,
            # A non-streamed answer has no TTFT (its first byte is its end): `streamed` false
            # says why it is empty; `held_ms` is the cold start the request waited through,
            # kept apart from its TTFT.
            "ttft_ms": row["ttft_ms"],
            "held_ms": row["held_ms"],
            "streamed": row["streamed"],
            # A list of prompts or `n` sequences: the engine requests and sequences its tokens
            # and MU count (one each otherwise).
            "prompts": row["prompts"] or 1,
            "sequences": row["sequences"] or 1,
            "mu": row["mu"],
            "guaranteed_mu": row["receipt_guaranteed_mu"],
            "best_effort_mu": row["receipt_best_effort_mu"],
            "estimated_mu": row["estimated_mu"],
            "cost_model_id": row["cost_model_id"],
            "cost_model_version": versions[row["cost_model_id"]],
        }
        for row in rows
    ]


RECEIPT_COLUMNS = (
    "event_id",
    "customer",
    "model",
    "started_at",
    "finished_at",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "images",
    "outcome",
    "admission_class",
    "verification",
    "self_reported",
    "api_key",
    "ttft_ms",
    "held_ms",
    "streamed",
    "prompts",
    "sequences",
    "mu",
    "guaranteed_mu",
    "best_effort_mu",
    "estimated_mu",
    "cost_model_id",
    "cost_model_version",
)


# --- Latency: how many guaranteed requests got their first token in time -------------------


@dataclass(frozen=True)
class TtftCounts:
    """A customer's guaranteed requests that ran in a window, against a TTFT objective."""

    counted: int  # measured by a gateway: the attainment's denominator
    within: int  # of those, in time (with the cold start they were held for, under keep-warm)
    without_ttft: int  # every other one: shown, never guessed (the two below among them)
    not_streamed: int = 0  # whose answer came whole: its first byte is its end, no TTFT
    self_reported: int = 0  # posted by the customer's own key: never counted for a credit


def keep_warm_customers(*, served_model_id: int, start: datetime, end: datetime) -> set[int]:
    """Customers whose reservation of the model kept it warm at some time in [start, end): the
    cold starts they were held for are theirs to count (they paid for none)."""
    return set(
        Reservation.objects.not_cancelled()
        .overlapping(start, end)
        .filter(served_model_id=served_model_id, keep_warm=True)
        .values_list("customer_id", flat=True)
    )


def guaranteed_ttft_counts(
    *, served_model_id: int, customer_ids, start: datetime, end: datetime, objective_ms: float
) -> dict[int, TtftCounts]:
    """Per customer, its guaranteed requests of the model that ran (refused ones are the
    refusal credit's) in the minutes [start, end), counted against `objective_ms`; one
    grouped query on the events (index: customer, model, minute). A customer without any is
    absent.

    Only what the customer experienced and the gateway measured counts: a TTFT a platform
    key reported (the gateway's own, from the end of any hold for a cold start); for a
    customer whose reservation keeps the model warm, plus the time it was held (a cold start
    it paid not to have), for one that declined keep-warm, not (the cold starts it accepted).
    A non-streamed request has no TTFT, and a customer's own report is never a credit's
    evidence: both are counted apart."""
    keep_warm = keep_warm_customers(served_model_id=served_model_id, start=start, end=end)
    measured = Q(ttft_ms__isnull=False, self_reported=False)
    in_time = Q(ttft_ms__lte=objective_ms) & ~Q(customer_id__in=keep_warm)
    if keep_warm:
        in_time |= Q(customer_id__in=keep_warm, experienced_ms__lte=objective_ms)
    rows = (
        UsageEvent.objects.filter(
            customer_id__in=customer_ids,
            served_model_id=served_model_id,
            minute__gte=start,
            minute__lt=end,
            admission_class=AdmissionClass.GUARANTEED,
        )
        .exclude(outcome=Outcome.REFUSED)
        .alias(experienced_ms=F("ttft_ms") + Coalesce(F("held_ms"), Value(0.0)))
        .values("customer_id")
        .annotate(
            counted=Count("id", filter=measured),
            within=Count("id", filter=measured & in_time),
            without_ttft=Count("id", filter=~measured),
            not_streamed=Count("id", filter=Q(streamed=False)),
            self_reported=Count("id", filter=Q(self_reported=True)),
        )
        .order_by()
    )
    return {
        row["customer_id"]: TtftCounts(
            row["counted"],
            row["within"],
            row["without_ttft"],
            row["not_streamed"],
            row["self_reported"],
        )
        for row in rows
    }
