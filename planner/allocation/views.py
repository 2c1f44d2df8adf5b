"""Allocation: what the loop decided and why, each model's prediction (its forecast beside its
demand), replica history, actuator failures, circuits."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone

from capacity.allocation.selectors import (
    actuator_circuit_of,
    circuits_open_and_failing,
    decisions_newest_first,
    latest_decision_per_deployment,
    recent_failed_decisions,
    replica_counts_per_step,
)
from capacity.catalog.selectors import any_deployments, deployments_with_model_and_gpu
from capacity.models import Deployment
from core.audit import entries_about
from planner.access import planner_required
from planner.allocation.prediction import prediction_panels, prediction_summary
from planner.audit.views import audit_link
from planner.charts import ChartConfig, chart_range, chart_window, line_chart, time_label
from planner.paging import page_of, query_without

RECENT_FAILURES = 20


def _changed_only(request: HttpRequest) -> bool:
    """Decisions that changed something (or failed to), or every tick's with ?all=1: a tick
    every 15 s that keeps the fleet as it is says nothing new."""
    return not request.GET.get("all")


@planner_required
def index(request: HttpRequest) -> HttpResponse:
    """The latest decision per deployment, each model's prediction, recent failures, circuits,
    and every decision."""
    now = timezone.now()
    circuits = circuits_open_and_failing(now=now)
    context = {
        "latest": latest_decision_per_deployment(),
        "predictions": prediction_panels(now=now),
        "failures": recent_failed_decisions(limit=RECENT_FAILURES),
        "open_circuits": circuits.open,
        "failing_circuits": circuits.failing,
        "page": page_of(request, decisions_newest_first(changed_only=_changed_only(request))),
        "query": query_without(request),
        "show_all": bool(request.GET.get("all")),
        "any_deployments": any_deployments(),
        "now": now,
    }
    return render(request, "planner/allocation/index.html", context)


def replica_history_chart(
    deployment: Deployment, request: HttpRequest
) -> tuple[str, ChartConfig | None]:
    """(range name, Chart.js config or None) of the deployment's target, recommended and
    running replicas over `?range=`."""
    range_name, span, step = chart_range(request)
    start, end = chart_window(timezone.now(), span, step)
    buckets = replica_counts_per_step(deployment=deployment, start=start, end=end, step=step)
    if not buckets:
        return range_name, None
    count = int(span / step)
    labels = [time_label(start + i * step, span) for i in range(count)]

    def series(key: str) -> list[float | None]:
        values: list[float | None] = []
        for i in range(count):
            slot = buckets.get(i)
            if slot is None:
                values.append(None)
            elif key == "current":
                values.append(round(sum(slot["current"]) / len(slot["current"]), 2))
            else:
                values.append(slot[key])
        return values

    chart = line_chart(
        labels,
        [
            {"label": "Target replicas (max)", "data": series("target"), "stepped": True},
            {"label": "Recommended (max)", "data": series("recommended"), "borderDash": [4, 3]},
            {
                "label": "Running before the tick (mean)",
                "data": series("current"),
                "fill": "origin",
            },
        ],
        y_title="Replicas",
    )
    return range_name, chart


@planner_required
def deployment(request: HttpRequest, name: str) -> HttpResponse:
    """One deployment: its replica history, its decisions, its actuator's circuit, and whether
    its model is sized by prediction (the model's panel is on the allocation page)."""
    deployment = get_object_or_404(deployments_with_model_and_gpu(), name=name)
    range_name, chart = replica_history_chart(deployment, request)
    decisions = decisions_newest_first(deployment=deployment, changed_only=_changed_only(request))
    context = {
        "deployment": deployment,
        "range": range_name,
        "chart": chart,
        "page": page_of(request, decisions),
        "query": query_without(request),
        "show_all": bool(request.GET.get("all")),
        "circuit": actuator_circuit_of(deployment),
        "prediction": prediction_summary(deployment.served_model),
        "now": timezone.now(),
        "history": entries_about(deployment, limit=20),
        "history_link": audit_link(deployment),
    }
    return render(request, "planner/allocation/deployment.html", context)
