"""The periodic tasks this app wants, written into django-celery-beat's tables.

Rows are keyed by name and updated in place, so `setup_periodic_tasks` can run at every
deploy; planners may then edit times in the admin (a re-run resets only what it owns: the
task, its arguments, and whether it is enabled).
"""

import json

from django.db import transaction
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from capacity.models import Deployment

NIGHTLY_PREFIX = "nightly benchmark: "
REAPER_NAME = "benchmarks: fail stale runs"


@transaction.atomic
def sync_benchmark_schedules(*, hour_utc: int = 2, minute: int = 0) -> dict[str, int]:
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
    nightly, _ = CrontabSchedule.objects.get_or_create(
        minute=str(minute),
        hour=str(hour_utc),
        day_of_week="*",
        day_of_month="*",
        month_of_year="*",
        timezone="UTC",
    )
    wanted = Deployment.objects.filter(benchmark_nightly=True, benchmark_suite__isnull=False)
    names = set()
    created = 0
    for deployment in wanted:
        name = NIGHTLY_PREFIX + deployment.name
        names.add(name)
        task = PeriodicTask.objects.filter(name=name).first()
        if task is None:
            PeriodicTask.objects.create(
                name=name,
                task="benchmarking.benchmark_deployment",
                crontab=nightly,
                args=json.dumps([deployment.pk]),
                queue="benchmarks",
                enabled=True,
            )
            created += 1
        else:
            # Keep a planner's edited time; own only what runs and with which arguments.
            task.task = "benchmarking.benchmark_deployment"
            task.args = json.dumps([deployment.pk])
            task.enabled = True
            task.save()
    disabled = (
        PeriodicTask.objects.filter(name__startswith=NIGHTLY_PREFIX, enabled=True)
        .exclude(name__in=names)
        .update(enabled=False)
    )
    return {"nightly": len(names), "created": created, "disabled": disabled}
