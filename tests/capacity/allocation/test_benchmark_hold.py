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


def test_a_deployment_at_zero_gets_its_benchmark_replica_for_the_run_and_loses_it_after(
    sellable, served_model
):
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=0, min_replicas=0, target_utilisation=1.0
    )
    deployment = Deployment.objects.get(name="llama-8b-h100")
    assert allocation_tick().decisions[0]["target_replicas"] == 0  # idle, nothing sold: zero

    Deployment.objects.filter(pk=deployment.pk).update(benchmark_held_replicas=1)
    allocation_tick()

    # Started for the run: the target is the held replica alone (customers need none).
    started = AllocationDecision.objects.filter(deployment=deployment).order_by("-id").first()
    assert (started.current_replicas, started.recommended_replicas) == (0, 0)
    assert started.target_replicas == 1
    assert "benchmark_hold" in {r["code"] for r in started.reasons}
    deployment.refresh_from_db()
    assert deployment.current_replicas == 1  # a dry run applies what it is told

    # Running, it is still no capacity: nothing ready for customers, no MU/min minted.
    running = allocation_tick()
    [outcome] = [m for m in running.models if m["model_id"] == served_model.pk]
    assert outcome["ready_mu_per_minute"] == 0
    latest = AllocationDecision.objects.filter(deployment=deployment).order_by("-id").first()
    assert (latest.current_replicas, latest.target_replicas, latest.ready_replicas) == (1, 1, 0)

    # Released: stopped after the run, back to zero at once.
    Deployment.objects.filter(pk=deployment.pk).update(benchmark_held_replicas=0)
    allocation_tick()
    stopped = AllocationDecision.objects.filter(deployment=deployment).order_by("-id").first()
    assert (stopped.current_replicas, stopped.target_replicas) == (1, 0), stopped.reasons
    assert "benchmark_hold" not in {r["code"] for r in stopped.reasons}
    deployment.refresh_from_db()
    assert deployment.current_replicas == 0
