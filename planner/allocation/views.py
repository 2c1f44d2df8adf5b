"""Allocation: what the loop decided and why, replica history, actuator failures, circuits."""

from datetime import timedelta

from django.db.models import Avg, F, Max, Min, OuterRef, Q, Subquery
from django.db.models.functions import Trunc
from django.shortcuts import get_object_or_404, render
from django.utils import timezone

from capacity.models import ActuatorCircuit, AllocationDecision, Deployment
from controlplane.audit import entries_about
from planner.access import planner_required
from planner.audit.views import audit_link
from planner.charts import chart_range, chart_window, line_chart, time_label
from planner.paging import page_of, query_without

RECENT_FAILURES = 20


def _latest_per_deployment():
    latest = AllocationDecision.objects.filter(deployment=OuterRef("pk")).order_by(
        "-created_at", "-id"
    )
    ids = (
        Deployment.objects.annotate(latest_id=Subquery(latest.values("id")[:1]))
        .exclude(latest_id=None)
        .values_list("latest_id", flat=True)
    )
    return (
        AllocationDecision.objects.filter(pk__in=list(ids))
        .select_related("deployment", "served_model")
        .order_by("deployment__name")
    )


def _decisions(request, decisions):
    """Decisions that changed something (or failed to), or every tick's with ?all=1: a tick
    every 15 s that keeps the fleet as it is says nothing new."""
    if not request.GET.get("all"):
        decisions = decisions.filter(
            ~Q(target_replicas=F("current_replicas")) | Q(actuator_ok=False)
        )
    return decisions.select_related("deployment").order_by("-created_at", "-id")


@planner_required
def index(request):
    now = timezone.now()
    failures = (
        AllocationDecision.objects.filter(actuator_ok=False)
        .select_related("deployment")
        .order_by("-created_at", "-id")[:RECENT_FAILURES]
    )
    circuits = ActuatorCircuit.objects.select_related("deployment").order_by(
        "-opened_until", "deployment__name"
    )
    context = {
        "latest": _latest_per_deployment(),
        "failures": failures,
        "open_circuits": [c for c in circuits if c.opened_until and c.opened_until > now],
        "failing_circuits": [
            c
            for c in circuits
            if c.consecutive_failures and not (c.opened_until and c.opened_until > now)
        ],
        "page": page_of(request, _decisions(request, AllocationDecision.objects.all())),
        "query": query_without(request),
        "show_all": bool(request.GET.get("all")),
        "any_deployments": Deployment.objects.exists(),
        "now": now,
    }
    return render(request, "planner/allocation/index.html", context)


def replica_history_chart(deployment, request):
    range_name, span, step = chart_range(request)
    start, end = chart_window(timezone.now(), span, step)
    kind = "hour" if step >= timedelta(hours=1) else "minute"
    rows = (
        AllocationDecision.objects.filter(
            deployment=deployment, created_at__gte=start, created_at__lt=end
        )
        .annotate(bucket=Trunc("created_at", kind))
        .values("bucket")
        .annotate(
            target=Max("target_replicas"),
            recommended=Max("recommended_replicas"),
            current=Avg("current_replicas"),
            observed_low=Min("observed_replicas"),
        )
        .order_by("bucket")
    )
    buckets: dict[int, dict] = {}
    for row in rows:
        index = int((row["bucket"] - start) / step)
        slot = buckets.setdefault(index, {"target": 0, "recommended": 0, "current": []})
        slot["target"] = max(slot["target"], row["target"])
        slot["recommended"] = max(slot["recommended"], row["recommended"])
        slot["current"].append(row["current"])
    if not buckets:
        return range_name, None
    count = int(span / step)
    labels = [time_label(start + i * step, span) for i in range(count)]

    def series(key):
        values = []
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
def deployment(request, name):
    deployment = get_object_or_404(
        Deployment.objects.select_related("served_model", "gpu_pool__gpu_type"), name=name
    )
    range_name, chart = replica_history_chart(deployment, request)
    decisions = _decisions(request, deployment.allocation_decisions.all())
    context = {
        "deployment": deployment,
        "range": range_name,
        "chart": chart,
        "page": page_of(request, decisions),
        "query": query_without(request),
        "show_all": bool(request.GET.get("all")),
        "circuit": ActuatorCircuit.objects.filter(deployment=deployment).first(),
        "now": timezone.now(),
        "history": entries_about(deployment, limit=20),
        "history_link": audit_link(deployment),
    }
    return render(request, "planner/allocation/deployment.html", context)
