"""The periodic tasks this app wants, written into django-celery-beat's tables; and each
deployment's nightly benchmark, whose beat row follows the deployment.

Rows are keyed by name and updated in place, so `setup_periodic_tasks` can run at every
deploy. A deployment's nightly benchmark is a beat row per deployment, written in the
transaction that writes the deployment (the API and the admin alike, through capacity.hooks:
benchmarking.references subscribes): ticking `benchmark_nightly` enables it, clearing it
disables it, changing `benchmark_hour_utc` moves its crontab, and a rolled-back write leaves
the row as it was. The flag and the hour are the deployment's (capacity); the suite it runs is
benchmarking's reference to it. Rows are written with `save()`/`delete()`, never a bulk update:
django-celery-beat's scheduler reloads only when those bump its change marker (`PeriodicTasks`).
"""

import json

from django.db import transaction
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from capacity.catalog.services import NIGHTLY_FIELDS
from capacity.models import Deployment

# A write that changes one of these re-syncs the deployment's beat row.
SCHEDULE_FIELDS = NIGHTLY_FIELDS | {"name"}

REAPER_NAME = "benchmarks: fail stale runs"


@transaction.atomic
def benchmarking_schedules_sync() -> dict[str, int]:
    """Write the benchmarking app's beat rows (the stale-run reaper) and re-sync every
    deployment's nightly row (nightly_schedules_sync); how many of each
    ("periodic", and the nightly counts)."""
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
    return {"periodic": 1, **nightly_schedules_sync()}


NIGHTLY_PREFIX = "nightly benchmark: "
# By name: the task module imports this one (through the services).
NIGHTLY_TASK = "benchmarking.benchmark_deployment"
NIGHTLY_QUEUE = "benchmarks"
# Nightly runs start on the hour; the deployment says which hour (UTC).
NIGHTLY_MINUTE = 0


def nightly_name(deployment: Deployment) -> str:
    """The beat row's name of a deployment's nightly benchmark."""
    return NIGHTLY_PREFIX + deployment.name


def _nightly_rows(deployment_pk: int):
    """The beat rows of a deployment's nightly benchmark, found by the argument they pass (the
    deployment's id), so a renamed deployment keeps its row."""
    return PeriodicTask.objects.filter(task=NIGHTLY_TASK, args=json.dumps([deployment_pk]))


def nightly_crontab(hour_utc: int) -> CrontabSchedule:
    """The crontab (UTC) a deployment's nightly benchmark runs at."""
    crontab, _ = CrontabSchedule.objects.get_or_create(
        minute=str(NIGHTLY_MINUTE),
        hour=str(hour_utc),
        day_of_week="*",
        day_of_month="*",
        month_of_year="*",
        timezone="UTC",
    )
    return crontab


def wants_nightly(deployment: Deployment) -> bool:
    """Whether the deployment asks for a nightly benchmark with a suite to run."""
    return deployment.benchmark_nightly and deployment.benchmark_suite is not None


@transaction.atomic
def deployment_schedule_sync(*, deployment: Deployment) -> PeriodicTask | None:
    """Make the deployment's nightly-benchmark row say what the deployment says: enabled
    exactly when it wants nightly runs, at its hour, under its current name. None when it has
    no row and wants none."""
    name = nightly_name(deployment)
    wanted = wants_nightly(deployment)
    task = _nightly_rows(deployment.pk).order_by("pk").first()
    if task is None:
        task = PeriodicTask.objects.filter(name=name).first()
    if task is None and not wanted:
        return None
    if task is None:
        task = PeriodicTask(name=name)
    if task.name != name:
        # Renamed: a stale row still holding the new name (of a deleted deployment) yields it.
        for stale in PeriodicTask.objects.filter(name=name, task=NIGHTLY_TASK).exclude(pk=task.pk):
            stale.delete()
        task.name = name
    task.task = NIGHTLY_TASK
    task.args = json.dumps([deployment.pk])
    task.queue = NIGHTLY_QUEUE
    task.interval = None
    task.crontab = nightly_crontab(deployment.benchmark_hour_utc)
    task.enabled = wanted
    task.save()
    return task


def deployment_schedule_delete(*, deployment_pk: int) -> int:
    """Remove a deleted deployment's nightly rows (one by one: beat must notice)."""
    rows = list(_nightly_rows(deployment_pk))
    for task in rows:
        task.delete()
    return len(rows)


@transaction.atomic
def nightly_schedules_sync() -> dict[str, int]:
    """Every deployment's nightly row as its deployment says; rows of deployments that no
    longer exist are disabled. What `setup_periodic_tasks` runs at every deploy."""
    rows = PeriodicTask.objects.filter(task=NIGHTLY_TASK)
    before = set(rows.values_list("pk", flat=True))
    enabled_before = set(rows.filter(enabled=True).values_list("pk", flat=True))
    owned = set()
    for deployment in Deployment.objects.all():
        task = deployment_schedule_sync(deployment=deployment)
        if task is not None:
            owned.add(task.pk)
    for task in rows.filter(enabled=True).exclude(pk__in=owned):
        task.enabled = False
        task.save()
    enabled_after = set(rows.filter(enabled=True).values_list("pk", flat=True))
    return {
        "nightly": len(enabled_after),
        "created": len(owned - before),
        "disabled": len(enabled_before - enabled_after),
    }
