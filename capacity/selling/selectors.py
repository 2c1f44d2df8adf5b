"""Reads of what is sold (reservations) for the planner's pages. The fleet's sold total per
model is `capacity.metering.utilisation.sold_now`."""

from datetime import datetime

from django.db.models import QuerySet, Sum

from capacity.models import Reservation


def reserved_mu_per_minute_by_customer(customer_ids, *, now: datetime) -> dict[int, float]:
    """MU per minute each customer has reserved at `now` (every model; cancelled ones not),
    in one grouped query; a customer without a reservation is absent."""
    return dict(
        Reservation.objects.filter(customer_id__in=customer_ids)
        .active_at(now)
        .values("customer_id")
        .annotate(total=Sum("mu_per_minute"))
        .values_list("customer_id", "total")
    )


def reservations_of_customer(customer) -> QuerySet[Reservation]:
    """The customer's reservations, by status, newest start first (with their model)."""
    return customer.reservations.select_related("served_model").order_by(
        "status", "-starts_at", "-id"
    )


def reservation_ids_of_customer(customer) -> QuerySet:
    return customer.reservations.values_list("pk", flat=True)


def reserved_model_ids_of_customer(customer) -> set[int]:
    """Ids of the models the customer holds or held a reservation of."""
    return set(customer.reservations.values_list("served_model_id", flat=True))


def reservation_of_customer(customer, pk: int) -> Reservation | None:
    """The customer's reservation with this id; None when it has none (or it is another's)."""
    return Reservation.objects.filter(customer=customer, pk=pk).first()
