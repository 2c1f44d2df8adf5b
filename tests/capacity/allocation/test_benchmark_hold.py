"""Replicas a benchmark run holds (benchmarking/isolation.py) in the tick: the target includes
them, the policy plans customers' capacity without them, and gateways never see them."""

import pytest
from django.utils import timezone

from capacity.allocation.tick import allocation_tick
from capacity.models import AllocationDecision, Deployment, Replica
from capacity.publication.documents import model_documents

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


@pytest.fixture
def fleet(sellable):
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1, min_replicas=1, target_utilisation=1.0
    )
    return Deployment.objects.get(name="llama-8b-h100")


def test_a_held_replica_is_added_to_the_target_and_kept_out_of_capacity(fleet):
    Deployment.objects.filter(pk=fleet.pk).update(benchmark_held_replicas=1)

    allocation_tick()

    decision = AllocationDecision.objects.get(deployment=fleet)
    assert (decision.current_replicas, decision.target_replicas) == (1, 2)
    assert "benchmark_hold" in {r["code"] for r in decision.reasons}
    fleet.refresh_from_db()
    assert fleet.current_replicas == 2  # a dry run applies what it is told

    allocation_tick()  # the held replica now runs: still no capacity, still in the target
    latest = AllocationDecision.objects.filter(deployment=fleet).order_by("-id").first()
    assert (latest.current_replicas, latest.target_replicas) == (2, 2)
    assert latest.ready_replicas == 1

    Deployment.objects.filter(pk=fleet.pk).update(benchmark_held_replicas=0)
    allocation_tick()
    # Released: the extra replica goes at once (the recommendations the stabilisation window
    # reads were the customers' own, never the held ones).
    released = AllocationDecision.objects.filter(deployment=fleet).order_by("-id").first()
    assert (released.current_replicas, released.target_replicas) == (2, 1)


def test_a_held_replica_is_never_published_to_the_gateways(fleet):
    now = timezone.now()
    for index in (0, 1):
        Replica.objects.create(
            deployment=fleet, key=f"process:{index}", url=f"http://10.0.0.{index + 5}:8000",
            last_ok_at=now, held_by_benchmark_run_id=7 if index == 0 else None,
        )  # fmt: skip

    [document] = model_documents(now=now).values()

    assert [r["endpoint"] for r in document["replicas"]] == ["http://10.0.0.6:8000"]
