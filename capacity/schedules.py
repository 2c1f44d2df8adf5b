"""The capacity app's periodic tasks, written into django-celery-beat's tables by name.

Rows are written with `update_or_create`, never a bulk update: django-celery-beat's scheduler
reloads only when a save bumps its change marker (`PeriodicTasks`). Each deployment's nightly
benchmark row is benchmarking's (benchmarking.schedules).
"""

from django.conf import settings
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

# The tick and what feeds it on the `allocation` queue, which no long task shares (its worker
# takes nothing else: controlplane/workers.py); the probes on their own.
QUEUES = {
    "capacity.allocation_tick": "allocation",
    "capacity.usage_rollup": "allocation",
    "capacity.reservations_refresh_status": "allocation",
    "capacity.capacity_sample": "allocation",
    "capacity.usage_reap": "allocation",
    "capacity.health_probes": "health",
}
SCHEDULES = {
    # name: (task, every seconds, expires seconds)
    "usage: fold events into minute rollups": ("capacity.usage_rollup", 30, 25),
    "reservations: refresh status": ("capacity.reservations_refresh_status", 60, 55),
    # Expires under the interval, so a backlog never runs stale ticks back to back.
    "allocation: tick": ("capacity.allocation_tick", 15, 12),
    # One sample per model per minute (a second call in a minute writes nothing): every 30 s,
    # so that no minute is missed.
    "capacity: the minute's sample": ("capacity.capacity_sample", 30, 25),
    # Rule 3c's forecast, fitted off the tick (seconds a model; the tick only reads the curve).
    "allocation: fit the demand forecasts": ("capacity.demand_forecast_fit", 3600, 3000),
    # Requests whose gateway worker died holding their usage event (capacity.metering.reaper).
    "usage: reap requests without an event": ("capacity.usage_reap", 60, 55),
    # Its own queue and worker: probes never wait behind a benchmark or a tick.
    "health: inference probes": (
        "capacity.health_probes",
        settings.HEALTH_PROBE_INTERVAL_SECONDS,
        settings.HEALTH_PROBE_INTERVAL_SECONDS,
    ),
}


@transaction.atomic
def capacity_schedules_sync() -> dict[str, int]:
    """Write the capacity app's beat rows (SCHEDULES, each on its queue); how many
    ("periodic")."""
    for name, (task, every, expires) in SCHEDULES.items():
        interval, _ = IntervalSchedule.objects.get_or_create(
            every=every, period=IntervalSchedule.SECONDS
        )
        PeriodicTask.objects.update_or_create(
            name=name,
            defaults={
                "task": task,
                "interval": interval,
                "crontab": None,
                "queue": QUEUES.get(task, "default"),
                "expire_seconds": expires,
                "enabled": True,
            },
        )
    return {"periodic": len(SCHEDULES)}
