"""The capacity app's periodic tasks, written into django-celery-beat's tables by name; and
each deployment's nightly benchmark, whose row follows the deployment.

A deployment's nightly benchmark is a beat row per deployment, written by the services that
write the deployment (capacity.catalog.services, and the admin through them) in the same
transaction: ticking `benchmark_nightly` enables it, clearing it disables it, changing
`benchmark_hour_utc` moves its crontab, and a rolled-back write leaves the row as it was. The
row names the task by its string, "benchmarking.benchmark_deployment", so capacity never
imports benchmarking (the dependency order); the task re-reads the deployment when it fires.
Rows are written with `save()`/`delete()`, never a bulk update: django-celery-beat's scheduler
reloads only when those bump its change marker (`PeriodicTasks`).
"""

import json

from django.conf import settings
from django.db import transaction
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from capacity.models import Deployment

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


NIGHTLY_PREFIX = "nightly benchmark: "
NIGHTLY_TASK = "benchmarking.benchmark_deployment"
NIGHTLY_QUEUE = "benchmarks"
# Nightly runs start on the hour; the deployment says which hour (UTC).
NIGHTLY_MINUTE = 0


def nightly_name(deployment: Deployment) -> str:
    return NIGHTLY_PREFIX + deployment.name


def _nightly_rows(deployment_pk: int):
    """The beat rows of a deployment's nightly benchmark, found by the argument they pass (the
    deployment's id), so a renamed deployment keeps its row."""
    return PeriodicTask.objects.filter(task=NIGHTLY_TASK, args=json.dumps([deployment_pk]))


def nightly_crontab(hour_utc: int) -> CrontabSchedule:
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
    return deployment.benchmark_nightly and deployment.benchmark_suite_id is not None


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
