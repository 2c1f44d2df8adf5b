"""Rule 3c of the policy (capacity.allocation.policy), live: the forecast fitted on a schedule,
what the tick's snapshot reads of it and of the delivered SLO, and what the tick writes back.

- `demand_forecast_fit` (the hourly task `capacity.demand_forecast_fit`): each model's demand per
  minute from the usage rollups (served MU plus the refused requests' estimated MU, all
  customers), the last four weeks at most, fitted (capacity.allocation.forecast) and stored on
  its ModelPrediction row. Off the tick: a fit costs up to seconds a model.
- `prediction_readings` (the snapshot, each tick): the stored forecast evaluated at now, the
  SLO correction in force, how long the model's demand has been recorded (as the last fit found
  it: a model whose traffic just began is reactive until the next fit, within the hour), and
  the delivered SLO over the last SLO window from the usage events (requests within the TTFT
  SLO over the requests that completed with a TTFT or were refused), in three queries for the
  whole fleet.
- `prediction_store` (the tick, after deciding): the correction it applied and what set each
  model's target, for the next tick and the planner's allocation page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q, Sum
from django.utils import timezone

from capacity.allocation.forecast import (
    MAX_HISTORY_MINUTES,
    MIN_HISTORY_MINUTES,
    Forecast,
    ForecastFigures,
    figures,
    fit,
)
from capacity.allocation.policy import RECENT_WINDOW_SECONDS, Decisions, Snapshot
from capacity.allocation.slo import SLO_WINDOW_SECONDS
from capacity.models import ModelPrediction, Outcome, ServedModel, UsageEvent, UsageMinute

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictionReading:
    """What a tick's snapshot reads for one model's rule 3c."""

    enabled: bool
    history_seconds: float
    delivered_attainment: float | None
    delivered_requests: int
    correction_in_force: float
    forecast: ForecastFigures


def demand_forecast_fit(*, now: datetime | None = None) -> dict[str, int]:
    """Fit every model's forecast with prediction on, from its rollups; how many were fitted
    and how many had too little history ("fitted", "too_little_history")."""
    now = now or timezone.now()
    end = now.replace(second=0, microsecond=0)
    since = end - timedelta(minutes=MAX_HISTORY_MINUTES)
    models = list(ServedModel.objects.filter(prediction_enabled=True).values_list("pk", flat=True))
    per_model: dict[int, dict[int, float]] = {pk: {} for pk in models}
    rows = (
        UsageMinute.objects.filter(served_model_id__in=models, minute__gte=since, minute__lt=end)
        .values("served_model_id", "minute")
        .annotate(mu=Sum("mu"), refused_mu=Sum("refused_mu"))
        .values_list("served_model_id", "minute", "mu", "refused_mu")
    )
    for model_id, minute, mu, refused_mu in rows:
        index = int((minute - since).total_seconds() // 60)
        minutes = per_model[model_id]
        minutes[index] = minutes.get(index, 0.0) + (mu or 0.0) + (refused_mu or 0.0)
    fitted = short = 0
    for model_id, minutes in per_model.items():
        first = min(minutes, default=MAX_HISTORY_MINUTES)
        demand_since = since + timedelta(minutes=first) if minutes else None
        series = [minutes.get(i, 0.0) for i in range(first, MAX_HISTORY_MINUTES)]
        forecast = fit(series, end_s=end.timestamp()) if series else None
        if forecast is None:
            short += 1
            note = (
                f"{len(series) // 60} h of demand recorded, of the "
                f"{MIN_HISTORY_MINUTES // 60} h a forecast needs: no forecast yet"
            )
            values = {"forecast": {}, "fitted_at": now, "fit_note": note}
            values["demand_since"] = demand_since
        else:
            fitted += 1
            note = (
                f"{forecast.method} on {forecast.history_minutes / 60:.0f} h of demand, "
                f"±{forecast.band_mu_per_minute:.0f} MU/min (80 %)"
            )
            values = {"forecast": forecast.as_dict(), "fitted_at": now, "fit_note": note}
            values["demand_since"] = demand_since
        ModelPrediction.objects.update_or_create(served_model_id=model_id, defaults=values)
    return {"fitted": fitted, "too_little_history": short}


def prediction_readings(
    now: datetime,
    enabled: dict[int, bool],
    cold_start_seconds: dict[int, float],
    tick_seconds: float,
) -> dict[int, PredictionReading]:
    """Per model of `enabled` (its planners' switch, as the snapshot read the model), rule
    3c's inputs at `now` (`cold_start_seconds`: each model's quickest deployment's, the
    forecast's horizon with the tick)."""
    stored = {
        row.served_model_id: row
        for row in ModelPrediction.objects.only(
            "served_model_id", "forecast", "slo_correction", "demand_since"
        )
    }
    slo = _delivered_slo(now)
    readings = {}
    for model_id, on in enabled.items():
        row = stored.get(model_id)
        first = row.demand_since if row is not None else None
        met, asked = slo.get(model_id, (0, 0))
        forecast = _forecast_of(row) if on else None
        readings[model_id] = PredictionReading(
            enabled=on,
            history_seconds=max(0.0, (now - first).total_seconds()) if first else 0.0,
            delivered_attainment=met / asked if asked else None,
            delivered_requests=asked,
            correction_in_force=row.slo_correction if row is not None else 1.0,
            forecast=figures(
                forecast,
                now.timestamp(),
                horizon_seconds=cold_start_seconds.get(model_id, 0.0) + tick_seconds,
                level_age_seconds=RECENT_WINDOW_SECONDS / 2,
            ),
        )
    return readings


def _forecast_of(row: ModelPrediction | None) -> Forecast | None:
    if row is None or not row.forecast:
        return None
    try:
        return Forecast.from_dict(row.forecast)
    except (KeyError, TypeError, ValueError, AssertionError):
        logger.warning("the stored forecast of model %s cannot be read", row.served_model_id)
        return None


def _delivered_slo(now: datetime) -> dict[int, tuple[int, int]]:
    """Model → (requests within the TTFT SLO, requests) over the last SLO window: those that
    completed with a measured TTFT, and those refused (a refused request missed it); a request
    cancelled or failed says nothing of the capacity's latency, and one without a TTFT cannot
    be judged."""
    since = now - timedelta(seconds=SLO_WINDOW_SECONDS)
    slo_ms = settings.ALLOCATION_TTFT_SLO_MS
    judged = Q(outcome=Outcome.COMPLETED, ttft_ms__isnull=False) | Q(outcome=Outcome.REFUSED)
    rows = (
        UsageEvent.objects.filter(judged, started_at__gte=since, started_at__lt=now)
        .values("served_model_id")
        .annotate(
            asked=Count("pk"),
            met=Count("pk", filter=Q(outcome=Outcome.COMPLETED, ttft_ms__lte=slo_ms)),
        )
        .values_list("served_model_id", "met", "asked")
    )
    return {model_id: (met, asked) for model_id, met, asked in rows}


def prediction_store(now: datetime, snapshot: Snapshot, decisions: Decisions) -> int:
    """What rule 3c did for each model (the correction the next tick starts from, what set the
    target), on its ModelPrediction row; how many rows were written."""
    seen = {m.model_id: m for m in snapshot.models if m.prediction_enabled is not None}
    outcomes = [o for o in decisions.models if o.model_id in seen]
    if not outcomes:
        return 0
    rows = {
        row.served_model_id: row
        for row in ModelPrediction.objects.filter(
            served_model_id__in=[o.model_id for o in outcomes]
        )
    }
    changed: list[ModelPrediction] = []
    created: list[ModelPrediction] = []
    for outcome in outcomes:
        model = seen[outcome.model_id]
        row = rows.get(outcome.model_id) or ModelPrediction(served_model_id=outcome.model_id)
        row.predictive = outcome.predictive
        row.slo_correction = outcome.slo_correction
        row.slo_code = outcome.slo_code
        row.delivered_slo_attainment = model.delivered_slo_attainment
        row.delivered_requests = model.delivered_requests
        row.burst_headroom_mu_per_minute = outcome.burst_headroom_mu_per_minute
        row.forecast_now_mu_per_minute = model.forecast_now_mu_per_minute
        row.forecast_lift_mu_per_minute = outcome.forecast_lift_mu_per_minute
        row.set_by = outcome.set_by
        row.decided_at = now
        (changed if row.pk else created).append(row)
    fields = [
        "predictive",
        "slo_correction",
        "slo_code",
        "delivered_slo_attainment",
        "delivered_requests",
        "burst_headroom_mu_per_minute",
        "forecast_now_mu_per_minute",
        "forecast_lift_mu_per_minute",
        "set_by",
        "decided_at",
    ]
    ModelPrediction.objects.bulk_update(changed, fields)
    # A fit and a first tick may race to create a model's row: the fit's update_or_create
    # wins or waits, and this one skips the row it finds there.
    ModelPrediction.objects.bulk_create(created, ignore_conflicts=True)
    return len(changed) + len(created)
