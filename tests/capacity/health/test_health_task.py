"""The probes run as a Celery task on their own queue, scheduled by beat."""

import time

import pytest
from django_celery_beat.models import PeriodicTask

from capacity.models import ActuatorKind, DeploymentFingerprint, Replica
from capacity.schedules import capacity_schedules_sync
from capacity.tasks import health_probes
from tests.dataplane.supervisor.support import TINY_MODEL
from tests.support.processes import celery_worker_process, emulator_process


def test_beat_schedules_the_probes_on_the_health_queue(db, settings):
    capacity_schedules_sync()
    task = PeriodicTask.objects.get(task="capacity.health_probes")
    assert task.queue == "health"
    assert task.interval.every == settings.HEALTH_PROBE_INTERVAL_SECONDS
    assert task.expire_seconds <= settings.HEALTH_PROBE_INTERVAL_SECONDS


@pytest.mark.django_db(transaction=True)
def test_a_worker_on_the_health_queue_probes_a_deployment(sellable, served_model, tmp_path):
    served_model.engine_model_id = "tiny"
    served_model.save()
    with emulator_process({"models": [TINY_MODEL]}, tmp_path) as url:
        deployment = served_model.deployments.get()
        deployment.actuator_kind = ActuatorKind.DRY_RUN
        deployment.endpoint_url = url
        deployment.current_replicas = 1
        deployment.save()
        # Only the health queue: the probes need no other worker.
        with celery_worker_process(tmp_path, queues="health"):
            health_probes.delay()
            deadline = time.monotonic() + 30
            while not Replica.objects.filter(last_ok_at__isnull=False).exists():
                assert time.monotonic() < deadline, "the worker never probed"
                time.sleep(0.2)
    replica = Replica.objects.get()
    assert (replica.key, replica.url, replica.state) == ("endpoint", url, "healthy")
    assert DeploymentFingerprint.objects.get(deployment=deployment).recorded_from == "endpoint"
