"""The capacity app's periodic tasks, written into django-celery-beat's tables by name."""

from django.conf import settings
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

QUEUES = {"capacity.allocation_tick": "allocation", "capacity.health_probes": "health"}
SCHEDULES = {
    # name: (task, every seconds, expires seconds)
    "usage: fold events into minute rollups": ("capacity.usage_rollup", 30, 25),
    "reservations: refresh status": ("capacity.reservations_refresh_status", 60, 55),
    # Expires under the interval, so a backlog never runs stale ticks back to back.
    "allocation: tick": ("capacity.allocation_tick", 15, 12),
    # Its own queue and worker: probes never wait behind a benchmark or a tick.
    "health: inference probes": (
        "capacity.health_probes",
        settings.HEALTH_PROBE_INTERVAL_SECONDS,
        settings.HEALTH_PROBE_INTERVAL_SECONDS,
    ),
}


@transaction.atomic
def sync_capacity_schedules() -> int:
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
    return len(SCHEDULES)
