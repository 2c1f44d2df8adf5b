"""The capacity app's periodic tasks, written into django-celery-beat's tables by name."""

from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

SCHEDULES = {
    # name: (task, every seconds, expires seconds)
    "usage: fold events into minute rollups": ("capacity.usage_rollup", 30, 25),
    "reservations: refresh status": ("capacity.reservations_refresh_status", 60, 55),
    # Expires under the interval, so a backlog never runs stale ticks back to back.
    "allocation: tick": ("capacity.allocation_tick", 15, 12),
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
                "queue": "allocation" if task == "capacity.allocation_tick" else "default",
                "expire_seconds": expires,
                "enabled": True,
            },
        )
    return len(SCHEDULES)
