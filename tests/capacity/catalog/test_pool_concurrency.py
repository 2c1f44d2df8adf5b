"""A pool cannot shrink under a deployment being placed on it, even when both race."""

import threading

import pytest
from django.db import close_old_connections

from capacity.catalog import services
from capacity.models import Deployment, GpuPool
from core.errors import DomainError


@pytest.mark.django_db(transaction=True)
def test_a_pool_shrink_and_a_deployment_creation_never_both_win(served_model, pool):
    barrier = threading.Barrier(2)
    outcomes = {}

    def create():
        barrier.wait()
        try:
            services.deployment_create(
                name="racer",
                served_model=served_model,
                gpu_pool=GpuPool.objects.get(pk=pool.pk),
                gpus_per_replica=2,
                max_replicas=4,
            )
            outcomes["create"] = "ok"
        except DomainError:
            outcomes["create"] = "refused"
        finally:
            close_old_connections()

    def shrink():
        barrier.wait()
        try:
            services.gpu_pool_update(pool=GpuPool.objects.get(pk=pool.pk), gpu_count=4)
            outcomes["shrink"] = "ok"
        except DomainError:
            outcomes["shrink"] = "refused"
        finally:
            close_old_connections()

    for _ in range(5):
        Deployment.objects.filter(name="racer").delete()
        GpuPool.objects.filter(pk=pool.pk).update(gpu_count=8)
        threads = [threading.Thread(target=create), threading.Thread(target=shrink)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)

        pool.refresh_from_db()
        placed = Deployment.objects.filter(name="racer").first()
        assert sorted(outcomes.values()) == ["ok", "refused"], outcomes
        if placed is not None:
            assert pool.gpu_count == 8  # the shrink lost
        else:
            assert pool.gpu_count == 4  # the creation lost
        assert placed is None or placed.max_gpus <= pool.gpu_count
