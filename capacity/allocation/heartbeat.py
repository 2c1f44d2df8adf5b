"""The allocation tick's heartbeat, and what watches it (docs/design.md#fail-safe).

Admission never depends on a fresh tick: reservation floors are written when a sale changes
(capacity.admission.floors) and the best-effort allowances age in the admission script itself
(capacity.admission.bucket.best_effort_now). But a stalled tick is a fault an operator must
hear of. Every tick that completes writes the one `TickHeartbeat` row (`heartbeat_record`);
its age (`tick_age_seconds`) is

- the gauge `controlplane_allocation_tick_age_seconds` (read at scrape time, like
  mu_desired_replicas), and
- "degraded" in /readyz's detail (`allocation_tick: stale`; still 200: the API serves, and
  taking web pods out of their Service would not restart the tick), and
- an alert state above every planner page (`tick_state`),

and the health worker, whose queue and worker no long task shares, watches it on every probe
round (`tick_watch`): one signed alert to ALERT_WEBHOOK_URL when the tick goes stale
(ADMISSION_TICK_STALE_SECONDS) and one when it comes back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from capacity.models import TickHeartbeat
from capacity.telemetry.alerts import send_alert
from core.audit import audit_record

logger = logging.getLogger(__name__)

TICK_STALE = "allocation_tick_stale"


@dataclass(frozen=True)
class TickState:
    ticked_at: datetime | None  # None: no tick has completed yet
    age_seconds: float | None
    stale: bool
    stale_after_seconds: int


def heartbeat_record(*, tick_id, seconds: float, now: datetime | None = None) -> None:
    """A tick completed (capacity.allocation.tick)."""
    now = now or timezone.now()
    updated = TickHeartbeat.objects.filter(pk=1).update(
        ticked_at=now, tick_id=tick_id, tick_seconds=seconds
    )
    if not updated:
        TickHeartbeat.objects.get_or_create(
            pk=1, defaults={"ticked_at": now, "tick_id": tick_id, "tick_seconds": seconds}
        )


def tick_state(now: datetime | None = None) -> TickState:
    now = now or timezone.now()
    row = TickHeartbeat.objects.filter(pk=1).only("ticked_at").first()
    stale_after = settings.ADMISSION_TICK_STALE_SECONDS
    if row is None:
        return TickState(None, None, False, stale_after)
    age = max(0.0, (now - row.ticked_at).total_seconds())
    return TickState(row.ticked_at, age, age > stale_after, stale_after)


def tick_age_seconds(now: datetime | None = None) -> float | None:
    return tick_state(now).age_seconds


def readiness() -> str:
    """/readyz's `allocation_tick` (core.liveness.degrading_checks): "ok", "stale", or
    "unknown" before the first tick."""
    state = tick_state()
    if state.ticked_at is None:
        return "unknown"
    return "stale" if state.stale else "ok"


def tick_watch(now: datetime | None = None) -> str | None:
    """Alert once when the tick goes stale and once when it is back: "entered", "left" or
    None (no change). Run by the health worker every probe round."""
    now = now or timezone.now()
    with transaction.atomic():
        row = TickHeartbeat.objects.select_for_update().filter(pk=1).first()
        if row is None:
            return None
        age = (now - row.ticked_at).total_seconds()
        stale = age > settings.ADMISSION_TICK_STALE_SECONDS
        if stale == (row.stale_since is not None):
            return None
        state = "entered" if stale else "left"
        since = row.stale_since
        row.stale_since = now if stale else None
        row.save(update_fields=["stale_since"])
        audit_record(
            actor="system:tick-watch",
            action=f"allocation.tick_{'stale' if stale else 'recovered'}",
            obj=row,
            before={"stale_since": since.isoformat() if since else None},
            after={"stale_since": row.stale_since.isoformat() if row.stale_since else None},
        )
        payload = {
            "kind": TICK_STALE,
            "state": state,
            "at": now.isoformat(),
            "last_tick_at": row.ticked_at.isoformat(),
            "tick_age_seconds": round(age, 1),
            "stale_after_seconds": settings.ADMISSION_TICK_STALE_SECONDS,
        }
        transaction.on_commit(lambda: send_alert(payload))
    logger.warning(
        "allocation tick %s: last tick %s (%.0f s ago)",
        "stale" if stale else "recovered",
        row.ticked_at.isoformat(),
        age,
    )
    return state
