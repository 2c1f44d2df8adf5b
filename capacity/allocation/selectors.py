"""Reads of the allocation loop's decisions and actuator circuits for the planner's pages."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, F, Max, Min, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Trunc

from capacity.models import ActuatorCircuit, AdmissionAllowance, AllocationDecision, Deployment


def latest_decision_per_deployment() -> QuerySet[AllocationDecision]:
    """Each deployment's newest decision, by deployment name (the ids in one query now)."""
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


def decisions_newest_first(
    *, deployment: Deployment | None = None, changed_only: bool
) -> QuerySet[AllocationDecision]:
    """Decisions (of one deployment, when given); with changed_only, those whose target
    differs from the replicas running, or whose push failed."""
    decisions = AllocationDecision.objects.all()
    if deployment is not None:
        decisions = decisions.filter(deployment=deployment)
    if changed_only:
        decisions = decisions.filter(
            ~Q(target_replicas=F("current_replicas")) | Q(actuator_ok=False)
        )
    return decisions.select_related("deployment").order_by("-created_at", "-id")


def recent_failed_decisions(*, limit: int) -> QuerySet[AllocationDecision]:
    """The newest decisions whose actuator call failed, with their deployment."""
    return (
        AllocationDecision.objects.filter(actuator_ok=False)
        .select_related("deployment")
        .order_by("-created_at", "-id")[:limit]
    )


@dataclass(frozen=True)
class CircuitStates:
    open: list[ActuatorCircuit]
    """Circuits open now: pushes to their deployment wait."""
    failing: list[ActuatorCircuit]
    """Closed circuits whose last pushes failed."""


def circuits_open_and_failing(*, now: datetime) -> CircuitStates:
    """Circuits open now, and closed ones counting failures (one query)."""
    circuits = list(
        ActuatorCircuit.objects.select_related("deployment").order_by(
            "-opened_until", "deployment__name"
        )
    )
    return CircuitStates(
        open=[c for c in circuits if c.opened_until and c.opened_until > now],
        failing=[
            c
            for c in circuits
            if c.consecutive_failures and not (c.opened_until and c.opened_until > now)
        ],
    )


def actuator_circuit_of(deployment: Deployment) -> ActuatorCircuit | None:
    """The deployment's actuator circuit breaker, or None before its first failure."""
    return ActuatorCircuit.objects.filter(deployment=deployment).first()


def replica_counts_per_step(
    *, deployment: Deployment, start: datetime, end: datetime, step: timedelta
) -> dict[int, dict]:
    """Per step index from start: the largest target and recommended replica counts and the
    hourly or minutely means of the replicas running before each tick (one query)."""
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
    return buckets


def admission_allowances_of_customer(customer) -> QuerySet[AdmissionAllowance]:
    """The latest tick's admission limits of the customer, per model (by model name)."""
    return (
        AdmissionAllowance.objects.filter(customer=customer)
        .select_related("served_model")
        .order_by("served_model__name")
    )
