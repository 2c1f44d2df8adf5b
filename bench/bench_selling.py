"""One sale checked jointly (whole replicas; the figures keep their `joint_lp` names), beside the
per-model check it replaced.

50 models on 20 GPU pools of 64 GPUs, each model deployed on two pools (model i on pools i mod
20 and (i + 7) mod 20: every model shares pools, so all 50 are one group to check and lock),
with 5,000 reservations: four in five open-ended and started in the past, one in five with a
term of 1 to 30 days starting in the next 30 (about 1,000 moments where the sold total rises).
About 60 % of the fleet is sold.

Timed: `reservation_create` of 1 MU/min for a random model, in a transaction rolled back after
each sale, so every sale sees the same fleet. The baseline is the same call with the check it
replaced (the model's own deployable × (1 − headroom) × overcommit against its own sold peak,
counting shared pools in full), swapped in for the run; the two take turns round by round.
Reported: the p95 of each (nearest rank), and the median.
"""

import random
import time
from contextlib import contextmanager
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from accounts.services import customer_create
from bench.figures import Figure
from capacity.models import CostModel, Deployment, GpuPool, GpuType, Reservation, ServedModel
from capacity.selling import reservations
from capacity.selling.sellable import JointCapacity, model_capacity
from core.errors import ConflictError

MODELS = 50
POOLS = 20
RESERVATIONS = 5000
ROUNDS = 6
SALES_PER_ROUND = 20
WEIGHTS = {"input_tokens": 0.001, "output_tokens": 0.02, "request": 0.05}


class _Rollback(Exception):
    pass


def _fixture() -> tuple[list[ServedModel], object]:
    from capacity.pricing.features import mu_coefficients

    gpu = GpuType.objects.create(name="BENCH-SELL-GPU", memory_gb=80, hourly_cost_usd=2)
    pools = [
        GpuPool.objects.create(name=f"bench-sell-pool-{p}", gpu_type=gpu, gpu_count=64)
        for p in range(POOLS)
    ]
    models = []
    for i in range(MODELS):
        model = ServedModel.objects.create(
            name=f"bench-sell-{i}", engine_model_id=f"bench/{i}", parameters_billions=8,
            reference_gpu_type=gpu, context_length_tokens=8192, headroom=0.1,
        )  # fmt: skip
        for pool in (pools[i % POOLS], pools[(i + 7) % POOLS]):
            Deployment.objects.create(
                name=f"bench-sell-{i}-{pool.pk}", served_model=model, gpu_pool=pool,
                max_replicas=32,
            )  # fmt: skip
        models.append(model)
    # Active at once: what a fit that activated itself leaves (its review is not measured).
    mu = mu_coefficients(WEIGHTS, 100.0)
    CostModel.objects.bulk_create(
        CostModel(
            served_model=model, gpu_type=gpu, gpus_per_replica=1, version=1,
            features=list(WEIGHTS), weights_replica_seconds=WEIGHTS, mu_per_unit=mu,
            alpha_mu_per_input_token=mu["input_tokens"], beta_mu_per_output_token=mu[
                "output_tokens"], gamma_mu_per_request=mu["request"], sample_count=10,
            distinct_shapes=10, cv_mape=0.02, cv_worst_error=0.05, candidates=[], residuals=[],
            status=CostModel.Status.ACTIVE, activated_at=timezone.now(),
        )
        for model in models
    )  # fmt: skip
    customer = customer_create(name="Bench sell", slug="bench-sell")
    rng = random.Random(22)
    now = timezone.now()
    rows = []
    # 20 pools × 64 GPUs × 90 MU/min = 115,200 sellable; about 60 % sold.
    for _ in range(RESERVATIONS):
        model = rng.choice(models)
        if rng.random() < 0.8:
            starts, ends = now - timedelta(days=rng.uniform(1, 60)), None
        else:
            starts = now + timedelta(days=rng.uniform(0.01, 30))
            ends = starts + timedelta(days=rng.uniform(1, 30))
        rows.append(
            Reservation(customer=customer, served_model=model, mu_per_minute=rng.uniform(5, 20),
                        starts_at=starts, ends_at=ends,
                        status="active" if starts <= now else "pending")
        )  # fmt: skip
    Reservation.objects.bulk_create(rows, batch_size=1000)
    return models, customer


def _per_model_check(
    *, served_model, mu_per_minute, starts_at, ends_at, group=None, exclude_id=None
):
    """The check sales had before issue 22: the model alone, shared pools counted in full."""
    now = timezone.now()
    check_from = max(starts_at, now)
    capacity = model_capacity(served_model, now=now, joint=JointCapacity(0.0, 0.0))
    sellable = capacity.deployable_mu_per_minute * (1 - served_model.headroom)
    sellable *= served_model.overcommit
    overlapping = (
        Reservation.objects.filter(served_model=served_model)
        .not_cancelled()
        .overlapping(check_from, ends_at)
    )
    if exclude_id is not None:
        overlapping = overlapping.exclude(pk=exclude_id)
    terms = list(overlapping.values_list("starts_at", "ends_at", "mu_per_minute"))
    moments = {check_from} | {start for start, _, _ in terms if start > check_from}
    peak = 0.0
    for moment in sorted(moments):
        total = sum(
            mu for start, end, mu in terms if start <= moment and (end is None or end > moment)
        )
        peak = max(peak, total)
    if peak + mu_per_minute > sellable + 1e-6:
        raise ConflictError("does not fit", code="insufficient_capacity")


@contextmanager
def _checked_by(check):
    original = reservations._check_fits
    reservations._check_fits = check
    try:
        yield
    finally:
        reservations._check_fits = original


def _sale(models, customer, rng) -> float:
    model = rng.choice(models)
    started = time.perf_counter()
    try:
        with transaction.atomic():
            reservations.reservation_create(customer=customer, served_model=model, mu_per_minute=1)
            raise _Rollback
    except _Rollback:
        pass
    return time.perf_counter() - started


def _p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(1, -(-95 * len(ordered) // 100)) - 1]


def run() -> list[Figure]:
    models, customer = _fixture()
    rng = random.Random(5)
    joint, per_model = [], []
    for _ in range(3):  # warm-up: SciPy's import, the query plans
        _sale(models, customer, rng)
        with _checked_by(_per_model_check):
            _sale(models, customer, rng)
    for _ in range(ROUNDS):
        joint.extend(_sale(models, customer, rng) for _ in range(SALES_PER_ROUND))
        with _checked_by(_per_model_check):
            per_model.extend(_sale(models, customer, rng) for _ in range(SALES_PER_ROUND))
    if Reservation.objects.count() != RESERVATIONS:
        raise AssertionError("a timed sale was not rolled back")
    what = f"per-model check, {MODELS} models × {POOLS} pools × {RESERVATIONS} reservations"
    return [
        Figure(
            name="sale_p95_joint_lp",
            value=_p95(joint) * 1000,
            unit="ms/sale",
            baseline=_p95(per_model) * 1000,
            baseline_name=what,
        ),
        Figure(
            name="sale_median_joint_lp",
            value=sorted(joint)[len(joint) // 2] * 1000,
            unit="ms/sale",
            baseline=sorted(per_model)[len(per_model) // 2] * 1000,
            baseline_name=what,
        ),
    ]
