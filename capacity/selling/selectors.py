"""Reads of what is sold (reservations) for the planner's pages. The fleet's sold total per
model is `capacity.metering.utilisation.sold_now`."""

from datetime import datetime

from django.db.models import QuerySet, Sum

from capacity.models import CapacityRisk, Reservation

# As many as capacity.selling.at_risk keeps on a model's state.
MAX_NAMED_RESERVATIONS = 100


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
    """The ids of the customer's reservations (a lazy query)."""
    return customer.reservations.values_list("pk", flat=True)


def reserved_model_ids_of_customer(customer) -> set[int]:
    """Ids of the models the customer holds or held a reservation of."""
    return set(customer.reservations.values_list("served_model_id", flat=True))


def reservation_of_customer(customer, pk: int) -> Reservation | None:
    """The customer's reservation with this id; None when it has none (or it is another's)."""
    return Reservation.objects.filter(customer=customer, pk=pk).first()


# --- At-risk capacity (capacity.selling.at_risk) ------------------------------------------


def risk_of(served_model) -> CapacityRisk | None:
    """The model's capacity-risk row, None when it was never at risk."""
    return CapacityRisk.objects.filter(served_model=served_model).first()


def is_at_risk(reservation: Reservation, risk: CapacityRisk | None) -> bool:
    """Whether the reservation is in term while its model is short of sold capacity: named
    on the model's state, or (past the names kept) in term at its worst moment."""
    if risk is None or not risk.oversold or reservation.status == Reservation.Status.CANCELLED:
        return False
    if reservation.pk in risk.reservations_at_risk:
        return True
    at = risk.oversold_at
    return (
        at is not None
        and reservation.starts_at <= at
        and (reservation.ends_at is None or reservation.ends_at > at)
        and len(risk.reservations_at_risk) >= MAX_NAMED_RESERVATIONS
    )


def risk_summary(served_model) -> dict:
    """The model's oversold and guaranteed-shortfall states, with the customers at risk."""
    risk = risk_of(served_model)
    if risk is None:
        return {
            "oversold": False,
            "oversold_mu_per_minute": 0.0,
            "oversold_since": None,
            "oversold_at": None,
            "reservations_at_risk": [],
            "customers_at_risk": [],
            "guaranteed_shortfall_mu_per_minute": 0.0,
            "guaranteed_shortfall_since": None,
            "checked_at": None,
        }
    customers = sorted(
        set(
            Reservation.objects.filter(pk__in=risk.reservations_at_risk).values_list(
                "customer__slug", flat=True
            )
        )
    )
    return {
        "oversold": risk.oversold,
        "oversold_mu_per_minute": risk.oversold_mu_per_minute,
        "oversold_since": risk.oversold_since.isoformat() if risk.oversold_since else None,
        "oversold_at": risk.oversold_at.isoformat() if risk.oversold_at else None,
        "reservations_at_risk": list(risk.reservations_at_risk),
        "customers_at_risk": customers,
        "guaranteed_shortfall_mu_per_minute": risk.guaranteed_shortfall_mu_per_minute,
        "guaranteed_shortfall_since": risk.guaranteed_shortfall_since.isoformat()
        if risk.guaranteed_shortfall_since
        else None,
        "checked_at": risk.checked_at.isoformat(),
    }


def reservations_at_risk_of_customer(customer, *, served_model=None) -> list[Reservation]:
    """The customer's reservations (of one model, or of all) sold beyond what the fleet
    serves now: its "oversold" state."""
    risks = {
        risk.served_model_id: risk
        for risk in CapacityRisk.objects.filter(oversold_since__isnull=False)
    }
    if not risks:
        return []
    reservations = customer.reservations.filter(served_model_id__in=risks).not_cancelled()
    if served_model is not None:
        reservations = reservations.filter(served_model=served_model)
    return [r for r in reservations if is_at_risk(r, risks[r.served_model_id])]
