"""One allocation tick at fleet scale: 1,000 deployments, 10,000 customers, 20,000
reservations (plus recent usage for every customer).

- policy: `capacity.allocation.policy.decide` alone on the snapshot (target: under 200 ms);
- tick: the whole `allocation_tick` — snapshot queries, policy, decisions and allowances
  written, dry-run actuators applied (target: under 2 s);
both beside the time to simply load the same rows (deployments, reservations, recent usage
rollups) with plain queries.
"""

import random
import statistics
import time
from datetime import timedelta
from decimal import Decimal

from django.utils import timezone

from accounts.models import Customer
from bench.figures import Figure
from capacity.allocation import policy as allocation
from capacity.allocation.tick import allocation_tick, build_snapshot
from capacity.models import (
    Deployment,
    GpuPool,
    GpuType,
    Reservation,
    ServedModel,
    UsageMinute,
)
from capacity.pricing.cost_models import cost_model_record
from capacity.pricing.features import mu_coefficients

MODELS = 100
DEPLOYMENTS_PER_MODEL = 10
CUSTOMERS = 10_000
RESERVATIONS = 20_000
REPEATS = 5
WEIGHTS = {"input_tokens": 1e-4, "output_tokens": 2e-2, "request": 5e-2}


def _fleet() -> None:
    rng = random.Random(11)
    gpu_types = [
        GpuType.objects.create(name=f"G{n}", memory_gb=80, hourly_cost_usd=Decimal(1 + n))
        for n in range(4)
    ]
    pools = [
        GpuPool.objects.create(name=f"pool-{n}", gpu_type=gpu_types[n % 4], gpu_count=400)
        for n in range(40)
    ]
    models = [
        ServedModel.objects.create(
            name=f"model-{n}",
            engine_model_id=f"m{n}",
            parameters_billions=8,
            reference_gpu_type=gpu_types[0],
            context_length_tokens=8192,
        )
        for n in range(MODELS)
    ]
    for model in models:
        for gpu_type in gpu_types:
            scaled = {k: v * (1 + gpu_types.index(gpu_type) * 0.3) for k, v in WEIGHTS.items()}
            cost_model_record(
                served_model=model,
                gpu_type=gpu_type,
                gpus_per_replica=1,
                features=list(scaled),
                weights_replica_seconds=scaled,
                mu_per_unit=mu_coefficients(scaled),
                sample_count=10,
                distinct_shapes=10,
                cv_mape=0.02,
                cv_worst_error=0.05,
                candidates=[],
                residuals=[],
            )
    Deployment.objects.bulk_create(
        Deployment(
            name=f"dep-{m}-{d}",
            served_model=models[m],
            gpu_pool=pools[(m + d) % 40],
            gpus_per_replica=1,
            min_replicas=0,
            max_replicas=16,
            current_replicas=rng.randint(0, 4),
            actuator_kind="dry_run",
            actuator_config={},
        )
        for m in range(MODELS)
        for d in range(DEPLOYMENTS_PER_MODEL)
    )
    customers = Customer.objects.bulk_create(
        Customer(name=f"C{n}", slug=f"bench-c{n}") for n in range(CUSTOMERS)
    )
    now = timezone.now()
    Reservation.objects.bulk_create(
        Reservation(
            customer=customers[n % CUSTOMERS],
            served_model=models[rng.randrange(MODELS)],
            mu_per_minute=rng.uniform(0.5, 5),
            starts_at=now - timedelta(days=1),
            status="active",
            keep_warm=n % 50 == 0,
        )
        for n in range(RESERVATIONS)
    )
    minute = now.replace(second=0, microsecond=0)
    UsageMinute.objects.bulk_create(
        UsageMinute(
            customer=customers[n],
            served_model=models[n % MODELS],
            minute=minute - timedelta(minutes=1 + k),
            requests=5,
            mu=rng.uniform(0, 10),
            input_tokens=5000,
            output_tokens=1000,
        )
        for n in range(CUSTOMERS)
        for k in range(3)
    )


def _load_rows() -> None:
    now = timezone.now()
    list(Deployment.objects.values_list("id", "served_model_id", "gpu_pool_id", "current_replicas"))
    list(Reservation.objects.values_list("served_model_id", "customer_id", "mu_per_minute"))
    list(
        UsageMinute.objects.filter(minute__gte=now - timedelta(minutes=15)).values_list(
            "served_model_id", "customer_id", "mu"
        )
    )


def _median_seconds(call) -> float:
    samples = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        call()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def run() -> list[Figure]:
    _fleet()
    load_seconds = _median_seconds(_load_rows)
    snapshot, _, _ = build_snapshot(now=timezone.now())
    assert sum(len(m.deployments) for m in snapshot.models) == MODELS * DEPLOYMENTS_PER_MODEL
    assert sum(len(m.customers) for m in snapshot.models) >= CUSTOMERS
    policy_seconds = _median_seconds(lambda: allocation.decide(snapshot))
    tick_seconds = _median_seconds(allocation_tick)
    return [
        Figure(
            name="policy_1000_deployments",
            value=policy_seconds * 1000,
            unit="ms",
            baseline=load_seconds * 1000,
            baseline_name="loading the same rows",
        ),
        Figure(
            name="tick_1000_deployments",
            value=tick_seconds * 1000,
            unit="ms",
            baseline=load_seconds * 1000,
            baseline_name="loading the same rows",
        ),
    ]
