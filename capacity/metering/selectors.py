"""Reads of metered usage (the minute rollups) for the planner's pages. A model's usage now is
`capacity.metering.utilisation.used_now`; a customer's over time,
`capacity.metering.utilisation.customer_utilisation`."""

from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet, Sum

from capacity.models import UsageEvent, UsageMinute


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
