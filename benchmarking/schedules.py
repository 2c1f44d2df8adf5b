"""The periodic tasks this app wants, written into django-celery-beat's tables.

Rows are keyed by name and updated in place, so `setup_periodic_tasks` can run at every
deploy. Each deployment's nightly benchmark row is written by capacity (capacity.schedules)
whenever the deployment is, since its flag and hour live there; this re-syncs all of them.
"""

from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from capacity.schedules import nightly_schedules_sync

REAPER_NAME = "benchmarks: fail stale runs"


@transaction.atomic
def sync_benchmark_schedules() -> dict[str, int]:
    interval, _ = IntervalSchedule.objects.get_or_create(every=60, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.update_or_create(
        name=REAPER_NAME,
        defaults={
            "task": "benchmarking.reap_stale_runs",
            "interval": interval,
            "crontab": None,
            "queue": "benchmarks",
            "expire_seconds": 50,
            "enabled": True,
        },
    )
    return nightly_schedules_sync()
