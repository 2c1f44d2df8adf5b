"""Fleet: per model, capacity deployable / hot / sold / used now and over time; GPU pools."""

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from capacity.catalog.selectors import gpu_pool_usage_by_name, served_models_by_name
from capacity.metering.calibration import REQUEST_WEIGHT_CAP_TOKENS, calibrations
from capacity.metering.history import capacity_history
from capacity.metering.utilisation import sold_now, used_now
from capacity.models import ServedModel
from capacity.selling.selectors import risk_summary
from capacity.selling.sellable import joint_capacity, model_capacity
from planner.access import planner_required
from planner.charts import chart_range, chart_window, line_chart, time_label

# Per series of the capacity history: its key, label, colour and Chart.js style.
SERIES_STYLE: list[tuple[str, str, str, dict[str, Any]]] = [
    ("deployable", "Deployable", "#9ca3af", {"borderDash": [6, 4]}),
    ("hot", "Hot", "#16a34a", {}),
    ("sellable", "Sellable", "#9333ea", {"borderDash": [2, 3]}),
    ("sold", "Sold", "#2563eb", {}),
    ("used", "Used", "#dc2626", {"fill": "origin"}),
    ("oversold", "Oversold", "#b45309", {"borderDash": [1, 2]}),
    ("guaranteed_shortfall", "Guaranteed shortfall", "#7c2d12", {"borderDash": [4, 2]}),
]


def _model_rows(
    served_models: list[ServedModel],
    start: datetime,
    end: datetime,
    step: timedelta,
    span: timedelta,
) -> list[dict[str, Any]]:
    history = capacity_history([m.pk for m in served_models], start=start, end=end, step=step)
    buckets = int((end - start) / step)
    moments = [start + i * step for i in range(buckets)]
    labels = [time_label(moment, span) for moment in moments]
    rows = []
    joint = joint_capacity([m.pk for m in served_models]) if served_models else {}
    calibrated = calibrations(now=timezone.now())
    for served_model in served_models:
        capacity = model_capacity(served_model, joint=joint[served_model.pk])
        sold = sold_now(served_model)
        per_bucket = history[served_model.pk]
        chart = None
        if per_bucket:
            chart = line_chart(
                labels,
                [
                    {
                        "label": label,
                        "color": color,
                        "data": [
                            round(per_bucket[m][key], 2) if m in per_bucket else None
                            for m in moments
                        ],
                        **style,
                    }
                    for key, label, color, style in SERIES_STYLE
                ],
                y_title="MU per minute",
            )
        rows.append(
            {
                "model": served_model,
                "capacity": capacity,
                "sold": sold,
                "used": used_now(served_model),
                "overcommit_ratio": sold / capacity.deployable_mu_per_minute
                if capacity.deployable_mu_per_minute
                else None,
                "chart": chart,
                "chart_id": f"capacity-{served_model.pk}",
                "risk": risk_summary(served_model),
                # What gateways estimate input tokens with before the engine counts them.
                "calibration": calibrated.get(served_model.pk),
            }
        )
    return rows


@planner_required
def fleet(request: HttpRequest) -> HttpResponse:
    """Per model, capacity now and over `?range=`; the GPU pools and what they cost."""
    range_name, span, step = chart_range(request)
    start, end = chart_window(timezone.now(), span, step)
    served_models = list(served_models_by_name())
    pool_rows = gpu_pool_usage_by_name()
    context = {
        "range": range_name,
        "models": _model_rows(served_models, start, end, step, span),
        "pools": pool_rows,
        "request_weight_cap": REQUEST_WEIGHT_CAP_TOKENS,
        "running_cost_usd_per_hour": sum(
            (row["running_cost_usd_per_hour"] for row in pool_rows), Decimal("0")
        ),
    }
    return render(request, "planner/fleet/index.html", context)
