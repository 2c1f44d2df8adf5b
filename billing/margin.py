"""Revenue per model beside what its GPUs cost: the margin per model for a month.

Revenue: the amounts of the month's live invoices (draft and issued), by model. GPU cost: each
deployment holds its decided `target_replicas` from one allocation decision to the next, so
its GPU-hours are the sum over decisions of replicas × GPUs per replica × the time until the
next decision (clipped to the month), priced at its GPU type's hourly cost.
"""

from collections import defaultdict
from datetime import datetime
from decimal import Decimal

from django.db import connection
from django.db.models import Sum

from billing.models import Invoice, InvoiceLine
from billing.periods import period_bounds
from capacity.models import AllocationDecision, Deployment, ServedModel

_GPU_SECONDS_SQL = """
WITH in_force AS (
    -- Each deployment's last decision at or before the month's start: it holds into the month.
    SELECT deployment_id, MAX(created_at) AS since
    FROM capacity_allocationdecision
    WHERE NOT dry_run AND created_at <= %(start)s
    GROUP BY deployment_id
), spans AS (
    SELECT d.deployment_id, d.target_replicas,
           GREATEST(d.created_at, %(start)s) AS span_start,
           LEAST(COALESCE(LEAD(d.created_at) OVER (PARTITION BY d.deployment_id
                                                   ORDER BY d.created_at, d.id), %(end)s),
                 %(end)s) AS span_end
    FROM capacity_allocationdecision d LEFT JOIN in_force f USING (deployment_id)
    WHERE NOT d.dry_run AND d.created_at < %(end)s
      AND d.created_at >= COALESCE(f.since, %(start)s)
)
SELECT deployment_id,
       SUM(target_replicas * GREATEST(0, EXTRACT(EPOCH FROM span_end - span_start)))
FROM spans GROUP BY deployment_id
"""


def _replica_seconds(start: datetime, end: datetime) -> dict[int, float]:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_GPU_SECONDS_SQL, {"start": start, "end": end})
            return {deployment_id: float(seconds or 0) for deployment_id, seconds in cursor}
    return replica_seconds_in_python(start, end)


def replica_seconds_in_python(start: datetime, end: datetime) -> dict[int, float]:
    """The same as the SQL, for other databases (the SQLite demo)."""
    totals: dict[int, float] = defaultdict(float)
    last: dict[int, tuple[datetime, int]] = {}
    rows = (
        AllocationDecision.objects.filter(dry_run=False, created_at__lt=end)
        .order_by("deployment_id", "created_at", "pk")
        .values_list("deployment_id", "created_at", "target_replicas")
    )
    for deployment_id, created_at, replicas in rows.iterator():
        if deployment_id in last:
            since, held = last[deployment_id]
            span = (min(created_at, end) - max(since, start)).total_seconds()
            totals[deployment_id] += held * max(0.0, span)
        last[deployment_id] = (created_at, replicas)
    for deployment_id, (since, held) in last.items():
        totals[deployment_id] += held * max(0.0, (end - max(since, start)).total_seconds())
    return dict(totals)


def model_margins(period) -> dict:
    """Per model, the period's invoiced revenue (void invoices left out) beside its GPU cost:
    the GPU-hours its deployments held (from the allocation decisions) at their GPU type's
    hourly cost."""
    first, start, end = period_bounds(period)
    revenue: dict[int, Decimal] = defaultdict(Decimal)
    for model_id, amount in (
        InvoiceLine.objects.filter(invoice__period_start=first)
        .exclude(invoice__status=Invoice.Status.VOID)
        .values_list("served_model_id")
        .annotate(amount=Sum("amount"))
    ):
        if model_id is not None:
            revenue[model_id] += amount
    gpu_hours: dict[int, float] = defaultdict(float)
    gpu_cost: dict[int, Decimal] = defaultdict(Decimal)
    seconds = _replica_seconds(start, end)
    for deployment in Deployment.objects.filter(pk__in=list(seconds)).select_related(
        "gpu_pool__gpu_type"
    ):
        hours = seconds[deployment.pk] * deployment.gpus_per_replica / 3600.0
        gpu_hours[deployment.served_model_id] += hours
        gpu_cost[deployment.served_model_id] += Decimal(str(hours)) * (
            deployment.gpu_pool.gpu_type.hourly_cost_usd
        )
    names = dict(
        ServedModel.objects.filter(pk__in=set(revenue) | set(gpu_hours)).values_list("pk", "name")
    )
    rows = []
    for model_id, name in sorted(names.items(), key=lambda item: item[1]):
        income = revenue.get(model_id, Decimal(0)).quantize(Decimal("0.01"))
        cost = gpu_cost.get(model_id, Decimal(0)).quantize(Decimal("0.01"))
        rows.append(
            {
                "model": name,
                "revenue": str(income),
                "gpu_hours": round(gpu_hours.get(model_id, 0.0), 3),
                "gpu_cost": str(cost),
                "margin": str(income - cost),
                "margin_share": float((income - cost) / income) if income else None,
            }
        )
    return {"period": f"{first:%Y-%m}", "models": rows}
