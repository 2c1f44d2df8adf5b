"""Admission's rates as tests set them without selling anything: a guaranteed rate is a
reservation floor (capacity.admission.floors: what a sale writes), a best-effort rate the
tick's allowance (with the tick's heartbeat, so it is fresh). Both through the real writers."""

from __future__ import annotations

from datetime import timedelta

from capacity.admission.bucket import Floor
from capacity.admission.redis_buckets import Buckets


def set_rates(
    buckets: Buckets, rates: dict[tuple[int, int], tuple[float, float]], *, ttl_s: int = 600
) -> None:
    """(customer id, model id) -> (guaranteed, best-effort) MU/min."""
    buckets.publish_floors(
        {pair: Floor(g) for pair, (g, _) in rates.items() if g > 0}, pairs=list(rates)
    )
    buckets.publish_limits({pair: be for pair, (_, be) in rates.items()}, ttl_s)


def publish_allowances(allowances) -> None:
    """The tick's allowances as the gate publishes them, and their guaranteed rates as the
    floors a sale would have written (capacity.admission.gate's Buckets)."""
    from capacity.admission import gate

    gate.publish_limits(allowances)
    gate.buckets().publish_floors(
        {
            (a.customer_id, a.model_id): Floor(a.guaranteed_mu_per_minute)
            for a in allowances
            if a.guaranteed_mu_per_minute > 0
        },
        pairs=[(a.customer_id, a.model_id) for a in allowances],
    )


def reserve(customer, model, mu_per_minute: float):
    """A reservation in term since a minute ago, stored as sold (no sale's checks, no
    publication): what the floors and the Redis-down fallback read."""
    from django.utils import timezone

    from capacity.models import Reservation

    return Reservation.objects.create(
        customer=customer,
        served_model=model,
        mu_per_minute=mu_per_minute,
        starts_at=timezone.now() - timedelta(minutes=1),
        status="active",
    )
