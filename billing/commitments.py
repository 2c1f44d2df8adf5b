"""What a reservation committed to over time: its MU/min, minute by minute, as amended.

Amendments change a reservation in place and record `ReservationChange` rows with the old and
new values, so the MU/min in force at any time is rebuilt from them: the first change's old
value until it, then each new value from its `changed_at`. A commitment runs from `starts_at`
until `ends_at`, or until `cancelled_at` if it was cancelled earlier. `keep_warm` is rebuilt the
same way: the parts of the commitment during which it was set are what the keep-warm premium
prices.
"""

from dataclasses import dataclass
from datetime import datetime

from capacity.models import Reservation


@dataclass(frozen=True)
class CommitmentSegment:
    starts_at: datetime
    ends_at: datetime
    mu_per_minute: float


def commitment_segments(
    reservation: Reservation, changes: list, start: datetime, end: datetime
) -> list[CommitmentSegment]:
    """`changes`: the reservation's ReservationChange rows, oldest first."""
    stop = reservation.ends_at or end
    if reservation.cancelled_at is not None:
        stop = min(stop, reservation.cancelled_at)
    lo, hi = max(start, reservation.starts_at), min(end, stop)
    if lo >= hi:
        return []
    # (from, MU/min) steps. The creation record has no old value; amendments have both.
    amendments = [
        c
        for c in changes
        if "mu_per_minute" in (c.changes or {}) and c.changes["mu_per_minute"][0] is not None
    ]
    first = amendments[0].changes["mu_per_minute"][0] if amendments else reservation.mu_per_minute
    steps = [(reservation.starts_at, float(first))]
    steps += [(c.changed_at, float(c.changes["mu_per_minute"][1])) for c in amendments]
    segments = []
    for index, (step_start, mu) in enumerate(steps):
        step_end = steps[index + 1][0] if index + 1 < len(steps) else hi
        a, b = max(lo, step_start), min(hi, step_end)
        if a < b and mu > 0:
            segments.append(CommitmentSegment(a, b, mu))
    return segments


def _flag_steps(reservation: Reservation, changes: list, name: str) -> list[tuple[datetime, bool]]:
    """(from, value) steps of a boolean field amended over time, from the reservation's start."""
    amendments = [
        c for c in changes if name in (c.changes or {}) and c.changes[name][0] is not None
    ]
    first = amendments[0].changes[name][0] if amendments else getattr(reservation, name)
    steps = [(reservation.starts_at, bool(first))]
    steps += [(c.changed_at, bool(c.changes[name][1])) for c in amendments]
    return steps


def keep_warm_segments(
    reservation: Reservation, changes: list, start: datetime, end: datetime
) -> list[CommitmentSegment]:
    """The parts of the commitment in [start, end) during which keep-warm was set."""
    steps = _flag_steps(reservation, changes, "keep_warm")
    warm = []
    for index, (step_start, on) in enumerate(steps):
        step_end = steps[index + 1][0] if index + 1 < len(steps) else end
        if on:
            warm.append((step_start, step_end))
    segments = []
    for part in commitment_segments(reservation, changes, start, end):
        for lo, hi in warm:
            a, b = max(part.starts_at, lo), min(part.ends_at, hi)
            if a < b:
                segments.append(CommitmentSegment(a, b, part.mu_per_minute))
    return segments
