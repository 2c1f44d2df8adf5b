"""Admission that survives a late tick starts with a tick that is never late (issue 33, item
1): the allocation tick and what feeds it run on the `allocation` queue, taken by a worker of
their own (controlplane/workers.py, as make run, compose and Kubernetes start them), so long
tasks filling every slot of the benchmarks' worker never delay a tick."""

import time

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from capacity.models import TickHeartbeat
from capacity.schedules import QUEUES
from controlplane.celery import app
from controlplane.workers import WORKERS
from tests.support.long_tasks import OCCUPY
from tests.support.processes import celery_beat_process, celery_worker_as

pytestmark = pytest.mark.django_db(transaction=True)

TICK_SECONDS = 2
WATCH_SECONDS = 24


def every(task: str, seconds: int) -> None:
    """A beat row as capacity.schedules writes it: the task's queue is its QUEUES entry."""
    interval, _ = IntervalSchedule.objects.get_or_create(
        every=seconds, period=IntervalSchedule.SECONDS
    )
    PeriodicTask.objects.create(
        name=f"{task} every {seconds} s",
        task=task,
        interval=interval,
        queue=QUEUES.get(task, "default"),
        expire_seconds=seconds,
    )


def test_ticks_stay_on_schedule_while_long_tasks_fill_every_benchmark_slot(served_model, tmp_path):
    assert QUEUES["capacity.allocation_tick"] == "allocation"
    assert not {"benchmarks", "default"} & set(WORKERS["loop"].queues)
    app.control.purge()
    every("capacity.allocation_tick", TICK_SECONDS)
    every("capacity.usage_rollup", TICK_SECONDS)
    slots = WORKERS["main"].concurrency
    markers = [tmp_path / f"occupied-{n}" for n in range(slots + 2)]
    with (
        celery_worker_as("main", tmp_path, include="tests.support.long_tasks"),
        celery_worker_as("loop", tmp_path),
    ):
        # Every slot of the long work's worker taken, and more queued behind them.
        for marker in markers:
            app.send_task(OCCUPY, args=[WATCH_SECONDS * 4, str(marker)], queue="benchmarks")
        deadline = time.monotonic() + 60
        while sum(m.exists() for m in markers) < slots:
            assert time.monotonic() < deadline, "the long tasks never started"
            time.sleep(0.2)
        with celery_beat_process(tmp_path):
            seen: list = []
            deadline = time.monotonic() + 60
            while not TickHeartbeat.objects.exists():  # the first tick, once beat is up
                assert time.monotonic() < deadline, "no tick at all"
                time.sleep(0.2)
            watch_until = time.monotonic() + WATCH_SECONDS
            while time.monotonic() < watch_until:
                ticked_at = TickHeartbeat.objects.get().ticked_at
                if not seen or ticked_at != seen[-1]:
                    seen.append(ticked_at)
                time.sleep(0.2)
    busy = sum(m.exists() for m in markers)
    gaps = [(b - a).total_seconds() for a, b in zip(seen, seen[1:], strict=False)]
    # A tick every 2 s, all slots busy the whole time: a machine three times slower still
    # ticks at least every 15 s, so at least WATCH_SECONDS / 15 more times.
    assert busy == slots, f"{busy} long tasks running, not {slots}: the loop took one?"
    assert len(seen) >= WATCH_SECONDS // 15 + 1, seen
    assert max(gaps, default=0) <= 15, gaps
    print(f"\n{len(seen)} ticks in {WATCH_SECONDS} s beside {slots} long tasks; gaps {gaps}")
