"""The minute's capacity sample is a periodic task of its own, not a step of the tick."""

import pytest
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from capacity.allocation.tick import allocation_tick
from capacity.models import CapacitySample
from capacity.schedules import capacity_schedules_sync
from capacity.tasks import capacity_sample

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def test_beat_samples_often_enough_that_no_minute_is_missed(settings):
    capacity_schedules_sync()
    task = PeriodicTask.objects.get(task="capacity.capacity_sample")
    assert task.enabled
    # Beat's interval drifts against the clock's minutes: under a minute, every minute is hit.
    assert task.interval.every <= 30
    assert task.expire_seconds < task.interval.every


def test_the_tick_leaves_the_sample_to_the_task_which_writes_one_per_model_per_minute(
    sellable, served_model
):
    allocation_tick()
    assert not CapacitySample.objects.exists()  # the tick holds its lock for less

    assert capacity_sample() == {"samples": 1}
    assert capacity_sample() == {"samples": 0}  # the same minute again: nothing more
    sample = CapacitySample.objects.get(served_model=served_model)
    assert 0 <= (timezone.now() - sample.minute).total_seconds() < 120  # this minute's
    assert sample.deployable_mu_per_minute > 0
