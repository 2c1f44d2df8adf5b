"""Selling capacity: reservations that never oversell (docs/design.md#sold).

Every write that can grow what is sold first locks the rows of the served model and of every
model that shares a GPU pool with it (in id order: `lock_models_sharing_pools`), so
concurrent sales of models that compete for GPUs are checked one after another against the
same numbers. A sale is checked jointly with the other models' sales, in whole replicas
(capacity.selling.feasibility); one that does not fit at every moment of its term is refused
with the shortfall and the pools (or deployments) that bind (the linear relaxation's duals).
"""

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.models import Customer
from capacity.hooks import gateway_state_changed
from capacity.models import Reservation, ReservationChange, ServedModel
from capacity.selling.entitlements import entitlement_grant
from capacity.selling.sellable import (
    available_for,
    fits,
    joint_fleet,
    lock_models_sharing_pools,
    model_capacity,
    sold_moments,
)
from core.audit import audit_record, current_actor, in_request
from core.errors import ConflictError, DomainError

# Floating-point sums of MU must not refuse a sale that fits exactly.
EPSILON_MU = 1e-6
UNSET = object()


def _check_fits(
    *,
    served_model: ServedModel,
    mu_per_minute: float,
    starts_at: datetime,
    ends_at: datetime | None,
    group: list[int],
    exclude_id: int | None = None,
) -> None:
    """Under the lock of `group`, every model sharing a pool with this one (the caller took
    it with `lock_models_sharing_pools`)."""
    now = timezone.now()
    check_from = max(starts_at, now)
    fleet = joint_fleet(group, now=now)
    sold = sold_moments(fleet, start=check_from, end=ends_at, exclude_id=exclude_id)
    if fits(fleet, sold, served_model.pk, mu_per_minute):
        return
    # Refused: the numbers, at the moment that binds (slower paths are fine here).
    available = available_for(fleet, sold, served_model.pk)
    at = sold.moments[available.moment_index]
    column = fleet.programme.model_index[served_model.pk]
    sold_then = float(sold.demand[available.moment_index, column])
    oversold = available.mu_per_minute is None
    remaining = 0.0 if oversold else available.mu_per_minute
    sellable = max(0.0, sold_then + remaining)
    shortfall = mu_per_minute - remaining
    pools = [fleet.pool_names[pk] for pk in available.binding.pools]
    deployments = [fleet.deployment_names[pk] for pk in available.binding.deployments]
    sharing = sorted(name for pk, name in fleet.model_names.items() if pk != served_model.pk)
    capacity = model_capacity(served_model, now=now)
    if oversold:
        why = (
            "the models sharing its pools are already oversold at "
            f"{at.isoformat()}: nothing more can be sold there until they fit again"
        )
    else:
        why = (
            f"{sellable:.6g} MU/min is sellable given the other models' sales and "
            f"{sold_then:.6g} is already sold at {at.isoformat()}, so {shortfall:.6g} MU/min "
            "is missing"
        )
    binds = ", ".join([f"pool '{p}'" for p in pools] + [f"deployment '{d}'" for d in deployments])
    raise ConflictError(
        f"The fleet cannot serve {mu_per_minute:g} MU/min of '{served_model.name}': {why}"
        + (f" ({binds} binds)." if binds else "."),
        code="insufficient_capacity",
        field="mu_per_minute",
        details={
            "requested_mu_per_minute": mu_per_minute,
            "sellable_mu_per_minute": sellable,
            "sold_mu_per_minute": sold_then,
            "shortfall_mu_per_minute": shortfall,
            "peak_at": at.isoformat(),
            "binding_pools": pools,
            "binding_deployments": deployments,
            "models_sharing_pools": sharing,
            "already_oversold": oversold,
            "deployable_mu_per_minute": capacity.deployable_mu_per_minute,
            "headroom": capacity.headroom,
            "overcommit": capacity.overcommit,
        },
    )


def _status_for(starts_at: datetime, ends_at: datetime | None, now: datetime) -> str:
    if ends_at is not None and ends_at <= now:
        return Reservation.Status.EXPIRED
    if starts_at > now:
        return Reservation.Status.PENDING
    return Reservation.Status.ACTIVE


def _validate_start(starts_at: datetime) -> None:
    """A sale starts within RESERVATION_START_WINDOW_DAYS of now, either way."""
    window = timedelta(days=settings.RESERVATION_START_WINDOW_DAYS)
    now = timezone.now()
    if not now - window <= starts_at <= now + window:
        raise DomainError(
            f"starts_at must be within {window.days} days of now "
            f"({(now - window):%Y-%m-%d} to {(now + window):%Y-%m-%d}).",
            field="starts_at",
        )


def _validate_term(
    starts_at: datetime, ends_at: datetime | None, mu_per_minute: float, *, bound_length=True
) -> None:
    if not mu_per_minute > 0:
        raise DomainError("mu_per_minute must be greater than 0.", field="mu_per_minute")
    if ends_at is not None and ends_at <= starts_at:
        raise DomainError("ends_at must be after starts_at.", field="ends_at")
    if ends_at is not None and ends_at <= timezone.now():
        raise DomainError("ends_at is in the past: nothing would be sold.", field="ends_at")
    longest = timedelta(days=settings.RESERVATION_MAX_TERM_DAYS)
    if bound_length and ends_at is not None and ends_at - starts_at > longest:
        raise DomainError(
            f"ends_at must be at most {longest.days} days after starts_at "
            f"({starts_at + longest:%Y-%m-%d}); leave it empty for an open-ended reservation.",
            field="ends_at",
        )


@transaction.atomic
def reservation_create(
    *,
    customer: Customer,
    served_model: ServedModel,
    mu_per_minute: float,
    starts_at: datetime | None = None,
    ends_at: datetime | None = None,
    keep_warm: bool = False,
    notes: str = "",
    actor: str = "",
) -> Reservation:
    """Sell a reservation: checked under the group's lock against what the fleet can serve at every
    moment of its term (never oversold), audited, its floor written to admission after the
    commit."""
    starts_at = starts_at or timezone.now()
    _validate_start(starts_at)
    _validate_term(starts_at, ends_at, mu_per_minute)
    group = lock_models_sharing_pools([served_model.pk])
    served_model = ServedModel.objects.get(pk=served_model.pk)
    _check_fits(
        served_model=served_model,
        mu_per_minute=mu_per_minute,
        starts_at=starts_at,
        ends_at=ends_at,
        group=group,
    )
    reservation = Reservation.objects.create(
        customer=customer,
        served_model=served_model,
        mu_per_minute=mu_per_minute,
        starts_at=starts_at,
        ends_at=ends_at,
        keep_warm=keep_warm,
        notes=notes,
        status=_status_for(starts_at, ends_at, timezone.now()),
    )
    ReservationChange.objects.create(
        reservation=reservation,
        kind=ReservationChange.Kind.CREATED,
        changes={
            "mu_per_minute": [None, mu_per_minute],
            "starts_at": [None, starts_at.isoformat()],
            "ends_at": [None, ends_at.isoformat() if ends_at else None],
        },
        changed_by=actor,
    )
    _audit(
        reservation,
        "reservation.create",
        {
            "customer": [None, customer.slug],
            "mu_per_minute": [None, mu_per_minute],
            "starts_at": [None, starts_at.isoformat()],
            "ends_at": [None, ends_at.isoformat() if ends_at else None],
            "keep_warm": [None, keep_warm],
        },
        actor,
    )
    # Capacity sold for a model the customer's keys could not use would be refused at every
    # gateway: a sale entitles the customer to the model (withdrawn only by hand).
    entitlement_grant(customer=customer, served_model=served_model, actor=actor)
    _floor_changed(reservation, "reservation created")
    return reservation


@transaction.atomic
def reservation_amend(
    *,
    reservation: Reservation,
    mu_per_minute: float | None = None,
    ends_at=UNSET,
    keep_warm: bool | None = None,
    notes: str | None = None,
    actor: str = "",
) -> Reservation:
    """Growing (more MU/min, or a later or open end) re-checks capacity; shrinking never fails."""
    group = lock_models_sharing_pools([reservation.served_model_id])
    reservation = Reservation.objects.select_for_update().get(pk=reservation.pk)
    if reservation.status in (Reservation.Status.CANCELLED, Reservation.Status.EXPIRED):
        raise ConflictError(
            f"A {reservation.status} reservation cannot be amended.", field="status"
        )
    new_mu = reservation.mu_per_minute if mu_per_minute is None else mu_per_minute
    new_end = reservation.ends_at if ends_at is UNSET else ends_at
    grows_rate = new_mu > reservation.mu_per_minute
    grows_term = reservation.ends_at is not None and (
        new_end is None or new_end > reservation.ends_at
    )
    # Shrinking never fails: only a later end is held to the longest term.
    _validate_term(reservation.starts_at, new_end, new_mu, bound_length=grows_term)
    if grows_rate or grows_term:
        _check_fits(
            served_model=reservation.served_model,
            mu_per_minute=new_mu,
            starts_at=reservation.starts_at,
            ends_at=new_end,
            group=group,
            exclude_id=reservation.pk,
        )
    changes = {}
    for name, value in (
        ("mu_per_minute", new_mu),
        ("ends_at", new_end),
        ("keep_warm", reservation.keep_warm if keep_warm is None else keep_warm),
        ("notes", reservation.notes if notes is None else notes),
    ):
        old = getattr(reservation, name)
        if old != value:
            changes[name] = [
                old.isoformat() if isinstance(old, datetime) else old,
                value.isoformat() if isinstance(value, datetime) else value,
            ]
            setattr(reservation, name, value)
    if changes:
        reservation.status = _status_for(reservation.starts_at, reservation.ends_at, timezone.now())
        reservation.save()
        ReservationChange.objects.create(
            reservation=reservation,
            kind=ReservationChange.Kind.AMENDED,
            changes=changes,
            changed_by=actor,
        )
        _audit(reservation, "reservation.amend", changes, actor)
        _floor_changed(reservation, "reservation amended")
    return reservation


@transaction.atomic
def reservation_cancel(*, reservation: Reservation, actor: str = "") -> Reservation:
    """Cancel a reservation, audited; its floor leaves admission after the commit."""
    reservation = Reservation.objects.select_for_update().get(pk=reservation.pk)
    if reservation.status == Reservation.Status.CANCELLED:
        raise ConflictError("The reservation is already cancelled.", field="status")
    old_status = reservation.status
    reservation.status = Reservation.Status.CANCELLED
    reservation.cancelled_at = timezone.now()
    reservation.save(update_fields=["status", "cancelled_at", "updated_at"])
    ReservationChange.objects.create(
        reservation=reservation,
        kind=ReservationChange.Kind.CANCELLED,
        changes={"status": [old_status, Reservation.Status.CANCELLED]},
        changed_by=actor,
    )
    _audit(reservation, "reservation.cancel", {"status": [old_status, "cancelled"]}, actor)
    _floor_changed(reservation, "reservation cancelled")
    return reservation


def _floor_changed(reservation: Reservation, reason: str) -> None:
    """Admission's guaranteed rate is the reservation floor, written after the sale commits
    (capacity.admission.floors), not by the next allocation tick: a sale admits at once, and a
    stalled tick never takes it away."""
    gateway_state_changed(
        reason, floors_of=[(reservation.customer_id, reservation.served_model_id)]
    )


def _audit(reservation: Reservation, action: str, changes: dict, actor: str) -> None:
    """The reservation's own history keeps its changes; the audit log holds them beside every
    other change in the system, with the caller named the same way everywhere."""
    audit_record(
        # Inside a request the caller is known exactly; jobs and commands name themselves.
        actor=current_actor() if in_request() or not actor else f"system:{actor}",
        action=action,
        obj=reservation,
        before={name: pair[0] for name, pair in changes.items()},
        after={name: pair[1] for name, pair in changes.items()},
    )


def reservations_refresh_status(*, now: datetime | None = None) -> dict[str, int]:
    """Move pending → active → expired as time passes (a periodic task). The floors already
    stepped on time (their schedules carry every start and end); they are written again for
    the pairs that moved, so what Redis holds is what the database says."""
    now = now or timezone.now()
    with transaction.atomic():
        starting = Reservation.objects.filter(status=Reservation.Status.PENDING).in_term_at(now)
        ending = Reservation.objects.filter(
            status__in=[Reservation.Status.PENDING, Reservation.Status.ACTIVE], ends_at__lte=now
        )
        pairs = set(starting.values_list("customer_id", "served_model_id")) | set(
            ending.values_list("customer_id", "served_model_id")
        )
        activated = starting.update(status=Reservation.Status.ACTIVE)
        expired = ending.update(status=Reservation.Status.EXPIRED)
        if pairs:
            gateway_state_changed("reservations started or ended", floors_of=sorted(pairs))
    return {"activated": activated, "expired": expired}
