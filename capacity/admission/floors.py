"""Reservation floors: the guaranteed MU/min admission gives a customer on a model, from what
is sold, never from the allocation tick (docs/design.md#fail-safe).

Admission's guaranteed bucket runs at the floor (capacity.admission.redis_buckets, FLOOR_LUA).
A floor is written to Redis whenever a sale changes (a reservation created, amended or
cancelled: capacity.selling.reservations publishes after commit, capacity.publication writes
the floors of the pairs it names) and whole at least once a minute; it carries the steps its
terms already fix (a reservation that starts later, one that ends), so a start and an expiry
take effect on time with nobody awake to write them. A tick that stalls therefore never
takes a reservation away: it only leaves best-effort slack to age (`best_effort_now`).

The floor of (customer, model) at a moment is the sum of the MU/min of its reservations in
term then and not cancelled, the same rule as the tick's snapshot (`Reservation.active_at`).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Collection
from datetime import datetime

from django.db.models import Q

from capacity.admission.bucket import Floor
from capacity.models import Reservation


def _ms(moment: datetime) -> float:
    return moment.timestamp() * 1000.0


def floors_of(
    *, now: datetime, pairs: Collection[tuple[int, int]] | None = None
) -> dict[tuple[int, int], Floor]:
    """(customer id, model id) → its floor as of `now`, for every pair holding a reservation
    in term now or later (or only `pairs`); a pair absent holds none."""
    reservations = Reservation.objects.not_cancelled().filter(
        Q(ends_at__isnull=True) | Q(ends_at__gt=now)
    )
    if pairs is not None:
        if not pairs:
            return {}
        wanted = Q()
        for customer_id, model_id in set(pairs):
            wanted |= Q(customer_id=customer_id, served_model_id=model_id)
        reservations = reservations.filter(wanted)
    terms: dict[tuple[int, int], list[tuple[datetime, datetime | None, float]]] = defaultdict(list)
    for customer_id, model_id, starts_at, ends_at, mu in reservations.values_list(
        "customer_id", "served_model_id", "starts_at", "ends_at", "mu_per_minute"
    ):
        terms[(customer_id, model_id)].append((starts_at, ends_at, float(mu)))
    return {pair: floor_from_terms(held, now=now) for pair, held in terms.items()}


def floors_digest(floors: dict[tuple[int, int], Floor]) -> str:
    """A digest of every floor: equal digests, equal floors (the publication writes them whole
    only when it moved)."""
    text = repr(sorted(floors.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def floor_from_terms(
    terms: list[tuple[datetime, datetime | None, float]], *, now: datetime
) -> Floor:
    """The floor of one pair's terms `(starts_at, ends_at or None, MU/min)`: what is in term
    now, then a step at every later start and end."""
    now_mu = sum(mu for starts, ends, mu in terms if starts <= now and (ends is None or ends > now))
    changes: dict[datetime, float] = defaultdict(float)
    for starts, ends, mu in terms:
        if starts > now:
            changes[starts] += mu
        if ends is not None and ends > now:
            changes[ends] -= mu
    steps: list[tuple[float, float]] = []
    level = last = now_mu
    for moment in sorted(changes):
        level += changes[moment]
        # A sum of floats back at nothing is nothing (the key's expiry reads the last step).
        mu = 0.0 if abs(level) < 1e-9 else level
        # A term that ends as another of the same rate starts changes nothing: no step.
        if abs(mu - last) > 1e-9:
            steps.append((_ms(moment), mu))
            last = mu
    return Floor(mu_per_minute=now_mu, steps=tuple(steps))
