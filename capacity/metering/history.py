"""A model's capacity over time, for the planner's fleet charts (capacity.models.CapacitySample).

The `capacity.capacity_sample` task calls `record_capacity` every 30 s (beat,
capacity.schedules); one row per model per whole minute is kept (a second call in the same
minute writes nothing), so the history costs one small row per model per minute and no minute
is missed. It is a task of its own, not a step of the allocation tick: every model's sellable
figures take seconds at fleet scale (about 3 s at 1,000 deployments, 25 s at 10,000, longer
than the 15 s between ticks), which the tick, holding its lock, paid once a minute.
"""

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Avg, Q
from django.db.models.functions import Trunc
from django.utils import timezone

from capacity.metering.utilisation import sold_and_used_now_of
from capacity.models import CapacityRisk, CapacitySample, ServedModel
from capacity.selling.sellable import joint_capacity, model_capacity


def record_capacity(
    *, now: datetime | None = None, risk: dict[int, tuple[float, float]] | None = None
) -> int:
    """Store this minute's sample for every model that has a deployment (or sold capacity at
    risk); returns rows written. `risk`: per model, the MU/min oversold and the guaranteed
    shortfall; None: as the last re-check stored them (capacity.models.CapacityRisk, which
    every allocation tick writes through capacity.selling.at_risk.fleet_recheck)."""
    now = now or timezone.now()
    if risk is None:
        risk = {
            pk: (oversold, short)
            for pk, oversold, short in CapacityRisk.objects.values_list(
                "served_model_id", "oversold_mu_per_minute", "guaranteed_shortfall_mu_per_minute"
            )
        }
    minute = now.replace(second=0, microsecond=0)
    done = set(
        CapacitySample.objects.filter(minute=minute).values_list("served_model_id", flat=True)
    )
    at_risk = [pk for pk, values in risk.items() if any(values)]
    models = [
        served_model
        for served_model in ServedModel.objects.filter(
            Q(deployments__isnull=False) | Q(pk__in=at_risk)
        ).distinct()
        if served_model.pk not in done
    ]
    # The joint figures of every model at once: each group of models sharing pools read once.
    joint = joint_capacity([m.pk for m in models], now=now) if models else {}
    sold, used = sold_and_used_now_of([m.pk for m in models], now=now)
    rows = []
    for served_model in models:
        capacity = model_capacity(served_model, now=now, joint=joint[served_model.pk])
        oversold, short = risk.get(served_model.pk, (0.0, 0.0))
        rows.append(
            CapacitySample(
                served_model=served_model,
                minute=minute,
                deployable_mu_per_minute=capacity.deployable_mu_per_minute,
                hot_mu_per_minute=capacity.hot_mu_per_minute,
                sellable_mu_per_minute=capacity.sellable_mu_per_minute,
                sold_mu_per_minute=sold[served_model.pk],
                used_mu_per_minute=used[served_model.pk],
                oversold_mu_per_minute=oversold,
                guaranteed_shortfall_mu_per_minute=short,
            )
        )
    # A concurrent tick in the same minute may have written some: the constraint keeps one.
    CapacitySample.objects.bulk_create(rows, ignore_conflicts=True)
    CapacitySample.objects.filter(
        minute__lt=minute - timedelta(days=settings.CAPACITY_HISTORY_DAYS)
    ).delete()
    return len(rows)


SERIES = ("deployable", "hot", "sellable", "sold", "used", "oversold", "guaranteed_shortfall")


def capacity_history(
    served_model_ids: list[int], *, start: datetime, end: datetime, step: timedelta
) -> dict[int, dict[datetime, dict[str, float]]]:
    """Per model, per bucket start: the mean of each series over the bucket (one query)."""
    kind = "hour" if step >= timedelta(hours=1) else "minute"
    rows = (
        CapacitySample.objects.filter(
            served_model_id__in=served_model_ids, minute__gte=start, minute__lt=end
        )
        .annotate(bucket=Trunc("minute", kind))
        .values("served_model_id", "bucket")
        .annotate(**{name: Avg(f"{name}_mu_per_minute") for name in SERIES})
        .order_by("served_model_id", "bucket")
    )
    history: dict[int, dict[datetime, dict[str, float]]] = {i: {} for i in served_model_ids}
    step_seconds = step.total_seconds()
    for row in rows:
        # Minute buckets are folded into the step (e.g. 10 minutes) here: Trunc has no
        # "10 minutes", and the mean of means over equal minutes is the mean.
        offset = (row["bucket"] - start).total_seconds() // step_seconds
        bucket = start + timedelta(seconds=offset * step_seconds)
        slot = history[row["served_model_id"]].setdefault(
            bucket, {"n": 0, **dict.fromkeys(SERIES, 0.0)}
        )
        slot["n"] += 1
        for name in SERIES:
            slot[name] += row[name]
    for per_model in history.values():
        for slot in per_model.values():
            n = slot.pop("n")
            for name in SERIES:
                slot[name] /= n
    return history
