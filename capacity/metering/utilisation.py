"""Sold versus used per customer over time, from the minute rollups and the reservations."""

from datetime import datetime, timedelta

import numpy as np
from django.conf import settings
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from accounts.models import Customer
from capacity.models import Reservation, ServedModel, UsageMinute
from capacity.selling.selectors import risk_summary
from capacity.selling.sellable import model_capacity
from capacity.telemetry.prometheus import read_fleet_load
from core.errors import DomainError

MAX_BUCKETS = 5_000
MAX_RANGE = timedelta(days=400)
USED_NOW_WINDOW = timedelta(minutes=5)


def _p95(values: np.ndarray) -> float:
    # Nearest rank, the convention of the whole project (benchmarking.runner.percentile).
    if values.size == 0:
        return 0.0
    ordered = np.sort(values)
    rank = max(1, int(np.ceil(0.95 * ordered.size)))
    return float(ordered[rank - 1])


def customer_utilisation(
    *,
    customer: Customer,
    served_model: ServedModel,
    start: datetime,
    end: datetime,
    step: timedelta,
) -> list[dict]:
    if step < timedelta(minutes=1) or step.total_seconds() % 60:
        raise DomainError("step must be a whole number of minutes, at least 1.", field="step")
    if end <= start:
        raise DomainError("to must be after from.", field="to")
    if end - start > MAX_RANGE:
        raise DomainError(f"The range may span at most {MAX_RANGE.days} days.", field="from")
    start = start.replace(second=0, microsecond=0)
    minutes = int(np.ceil((end - start).total_seconds() / 60))
    step_minutes = int(step.total_seconds() // 60)
    buckets = int(np.ceil(minutes / step_minutes))
    if buckets > MAX_BUCKETS:
        raise DomainError(
            f"{buckets} steps asked for; at most {MAX_BUCKETS}. Use a larger step.", field="step"
        )

    if connection.vendor == "postgresql":
        used = _used_per_bucket_sql(customer, served_model, start, end, minutes, step_minutes)
    else:
        used = _used_per_bucket_python(customer, served_model, start, end, minutes, step_minutes)

    reserved = np.zeros(minutes)
    reservations = Reservation.objects.filter(
        customer=customer, served_model=served_model
    ).overlapping(start, end)
    for reservation in reservations:
        # A cancelled reservation counted until it was cancelled.
        stop = reservation.ends_at or end
        if reservation.status == Reservation.Status.CANCELLED and reservation.cancelled_at:
            stop = min(stop, reservation.cancelled_at)
        first = max(0, int((reservation.starts_at - start).total_seconds() // 60))
        last = min(minutes, int(np.ceil((stop - start).total_seconds() / 60)))
        if last > first:
            reserved[first:last] += reservation.mu_per_minute

    result = []
    for bucket in range(buckets):
        lo, hi = bucket * step_minutes, min(minutes, (bucket + 1) * step_minutes)
        totals = used.get(bucket, {})
        used_mu = totals.get("mu", 0.0)
        result.append(
            {
                "start": (start + timedelta(minutes=lo)).isoformat(),
                "end": (start + timedelta(minutes=hi)).isoformat(),
                "reserved_mu_per_minute": float(reserved[lo:hi].mean()),
                "used_mu_per_minute_mean": used_mu / (hi - lo),
                "used_mu_per_minute_p95_minute": totals.get("p95", 0.0),
                "used_mu_per_minute_peak_minute": max(totals.get("peak", 0.0), 0.0),
                "used_mu": used_mu,
                "guaranteed_mu": totals.get("guaranteed_mu", 0.0),
                "best_effort_mu": totals.get("best_effort_mu", 0.0),
                "requests": int(totals.get("requests", 0)),
                "refused_requests": int(totals.get("refused", 0)),
            }
        )
    return result


# Per bucket: sums, the peak minute, and the p95 minute counting minutes without usage as 0.
# With M minutes in a bucket of which n have a row, the nearest-rank p95 is the k-th smallest
# of M values, k = ceil(0.95 M); the M − n missing minutes are the smallest (0), so it is the
# (k − (M − n))-th smallest row, or 0 when that rank is not positive.
_USED_SQL = """
WITH rows AS (
    SELECT (extract(epoch FROM (minute - %(start)s))::bigint / 60 / %(step)s)::int AS bucket,
           mu, guaranteed_mu, best_effort_mu, refused_requests, requests
    FROM capacity_usageminute
    WHERE customer_id = %(customer)s AND served_model_id = %(model)s
      AND minute >= %(start)s AND minute < %(end)s
), sized AS (
    SELECT *, least(%(step)s, %(minutes)s - bucket * %(step)s) AS bucket_minutes FROM rows
)
SELECT bucket, sum(mu), max(mu), sum(guaranteed_mu), sum(best_effort_mu),
       sum(refused_requests), sum(requests),
       -- Out-of-range array subscripts (rank ≤ 0) give NULL, i.e. a p95 of 0.
       coalesce((array_agg(mu ORDER BY mu))[
           ceil(0.95 * max(bucket_minutes))::int - (max(bucket_minutes) - count(*))::int], 0)
FROM sized
GROUP BY bucket
"""


def _used_per_bucket_sql(customer, served_model, start, end, minutes, step_minutes) -> dict:
    with connection.cursor() as cursor:
        cursor.execute(
            _USED_SQL,
            {
                "start": start,
                "end": end,
                "step": step_minutes,
                "minutes": minutes,
                "customer": customer.pk,
                "model": served_model.pk,
            },
        )
        return {
            bucket: {
                "mu": mu or 0.0,
                "peak": peak or 0.0,
                "guaranteed_mu": guaranteed or 0.0,
                "best_effort_mu": best_effort or 0.0,
                "refused": refused or 0,
                "requests": requests or 0,
                "p95": p95 or 0.0,
            }
            for bucket, mu, peak, guaranteed, best_effort, refused, requests, p95 in cursor
        }


def _used_per_bucket_python(customer, served_model, start, end, minutes, step_minutes) -> dict:
    """The same per-bucket figures for SQLite (the `make run` default), in numpy."""
    names = ("mu", "guaranteed_mu", "best_effort_mu", "refused", "requests")
    per_minute = {name: np.zeros(minutes) for name in names}
    rows = UsageMinute.objects.filter(
        customer=customer, served_model=served_model, minute__gte=start, minute__lt=end
    ).values_list("minute", "mu", "guaranteed_mu", "best_effort_mu", "refused_requests", "requests")
    for minute, *values in rows.iterator(chunk_size=5000):
        index = int((minute - start).total_seconds() // 60)
        for name, value in zip(names, values, strict=True):
            per_minute[name][index] = value
    used = {}
    for bucket in range(int(np.ceil(minutes / step_minutes))):
        lo, hi = bucket * step_minutes, min(minutes, (bucket + 1) * step_minutes)
        mu = per_minute["mu"][lo:hi]
        used[bucket] = {name: float(per_minute[name][lo:hi].sum()) for name in names}
        used[bucket]["peak"] = float(mu.max()) if mu.size else 0.0
        used[bucket]["p95"] = _p95(mu)
    return used


def sold_now(served_model: ServedModel, *, now: datetime | None = None) -> float:
    now = now or timezone.now()
    return (
        Reservation.objects.filter(served_model=served_model)
        .active_at(now)
        .aggregate(total=Sum("mu_per_minute"))["total"]
        or 0.0
    )


def used_now(served_model: ServedModel, *, now: datetime | None = None) -> float:
    """MU/min over the last five whole minutes, from the rollups."""
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    total = UsageMinute.objects.filter(
        served_model=served_model, minute__gte=now - USED_NOW_WINDOW, minute__lt=now
    ).aggregate(total=Sum("mu"))["total"]
    return (total or 0.0) / (USED_NOW_WINDOW.total_seconds() / 60)


def sold_and_used_now_of(
    model_ids, *, now: datetime | None = None
) -> tuple[dict[int, float], dict[int, float]]:
    """`sold_now` and `used_now` of many models, in two grouped queries (the tick records every
    model's capacity sample each minute)."""
    now = now or timezone.now()
    ids = list(model_ids)
    sold = dict(
        Reservation.objects.filter(served_model_id__in=ids)
        .active_at(now)
        .values("served_model_id")
        .annotate(total=Sum("mu_per_minute"))
        .values_list("served_model_id", "total")
    )
    minute = now.replace(second=0, microsecond=0)
    used = dict(
        UsageMinute.objects.filter(
            served_model_id__in=ids, minute__gte=minute - USED_NOW_WINDOW, minute__lt=minute
        )
        .values("served_model_id")
        .annotate(total=Sum("mu"))
        .values_list("served_model_id", "total")
    )
    minutes = USED_NOW_WINDOW.total_seconds() / 60
    return (
        {pk: sold.get(pk) or 0.0 for pk in ids},
        {pk: (used.get(pk) or 0.0) / minutes for pk in ids},
    )


def _prometheus_used(served_model: ServedModel) -> tuple[float | None, dict[int, dict]]:
    """Engine-side load from Prometheus, when one is configured. Unknown is None, never 0."""
    if not settings.PROMETHEUS_URL:
        return None, {}
    deployments = list(served_model.deployments.select_related("served_model"))
    loads = read_fleet_load(deployments)
    per_deployment = {
        deployment_id: {
            "known": load.known,
            "reason": load.reason,
            "mu_per_minute": load.mu_per_minute,
            "requests_per_s": load.requests_per_s,
            "concurrency": load.concurrency,
            "kv_cache_usage": load.kv_cache_usage,
        }
        for deployment_id, load in loads.items()
    }
    known = [load.mu_per_minute for load in loads.values() if load.known]
    total = sum(known) if known and len(known) == len(loads) else None
    return total, per_deployment


def model_capacity_summary(served_model: ServedModel) -> dict:
    capacity = model_capacity(served_model)
    sold = sold_now(served_model)
    engine_used, engine_loads = _prometheus_used(served_model)
    return {
        "model": served_model.name,
        "deployable_mu_per_minute": capacity.deployable_mu_per_minute,
        "hot_mu_per_minute": capacity.hot_mu_per_minute,
        # Given the other models' sales now (models sharing pools compete for their GPUs).
        "sellable_mu_per_minute": capacity.sellable_mu_per_minute,
        # What an open-ended sale from now could still take, at every later moment too.
        "available_mu_per_minute": capacity.available_mu_per_minute,
        "sold_mu_per_minute": sold,
        "used_mu_per_minute": used_now(served_model),
        # What the engines report through Prometheus; null when it is unknown.
        "engine_used_mu_per_minute": engine_used,
        "overcommit_ratio": sold / capacity.deployable_mu_per_minute
        if capacity.deployable_mu_per_minute
        else None,
        "headroom": capacity.headroom,
        "overcommit": capacity.overcommit,
        # Sold capacity the fleet cannot serve (oversold) or the tick cannot make hot.
        "risk": risk_summary(served_model),
        "workload_mix": {
            "input_tokens": capacity.mix.rounded().input_tokens,
            "cached_input_tokens": capacity.mix.rounded().cached_input_tokens,
            "output_tokens": capacity.mix.rounded().output_tokens,
        },
        "deployments": [
            {
                "name": d.name,
                "gpu_pool": d.gpu_pool,
                "gpus_per_replica": d.gpus_per_replica,
                "deployable_replicas": d.deployable_replicas,
                "current_replicas": d.current_replicas,
                "mu_per_minute_per_replica": d.mu_per_minute_per_replica,
                "deployable_mu_per_minute": d.deployable_mu_per_minute,
                "hot_mu_per_minute": d.hot_mu_per_minute,
                "note": d.note,
                "engine_load": engine_loads.get(d.deployment_id),
            }
            for d in capacity.deployments
        ],
    }
