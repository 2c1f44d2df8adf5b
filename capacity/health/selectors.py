"""Reads of replica health (replicas, probes' fingerprints, incidents) and of degradation for
the planner's pages. Writes and timings are in `capacity.health.services`."""

from django.db.models import Count, Prefetch, Q, QuerySet

from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    Deployment,
    Incident,
    Replica,
    ServedModel,
)


def deployments_with_replicas_by_name() -> QuerySet[Deployment]:
    """Deployments by name, with their model, probe fingerprint and replicas (by key)."""
    return (
        Deployment.objects.select_related("served_model", "probe_fingerprint")
        .prefetch_related(Prefetch("replicas", queryset=Replica.objects.order_by("key")))
        .order_by("name")
    )


def _incidents_newest_first() -> QuerySet[Incident]:
    return Incident.objects.select_related("deployment", "replica").order_by("-detected_at", "-id")


def open_incidents_newest_first() -> QuerySet[Incident]:
    """Incidents still open, newest first (with deployment and replica)."""
    return _incidents_newest_first().filter(ended_at__isnull=True)


def ended_incidents_newest_first() -> QuerySet[Incident]:
    """Incidents that ended, newest first (with deployment and replica)."""
    return _incidents_newest_first().filter(ended_at__isnull=False)


def incidents_with_steps() -> QuerySet[Incident]:
    """Incidents with their deployment's model, replica and steps (the API's list)."""
    return Incident.objects.select_related("deployment__served_model", "replica").prefetch_related(
        "steps"
    )


def replica_counts_by_state() -> dict[str, int]:
    """How many replicas are healthy, unhealthy and gone (one query)."""
    return Replica.objects.aggregate(
        healthy=Count("id", filter=Q(state=Replica.State.HEALTHY)),
        unhealthy=Count("id", filter=Q(state=Replica.State.UNHEALTHY)),
        gone=Count("id", filter=Q(state=Replica.State.GONE)),
    )


def served_models_with_degradation_by_name() -> QuerySet[ServedModel]:
    """Models by name, with their degradation state and policy (and its fallback model)."""
    return ServedModel.objects.select_related(
        "degradation_state", "degradation_policy__fallback_model"
    ).order_by("name")


def served_models_with_degradation_state() -> QuerySet[ServedModel]:
    """Served models with their degradation state (one query)."""
    return ServedModel.objects.select_related("degradation_state")


def degradation_changes_newest_first() -> QuerySet[DegradationChange]:
    """Every degradation level change, newest first (with its model)."""
    return DegradationChange.objects.select_related("served_model").order_by("-at", "-id")


def degradation_policy_of(served_model: ServedModel) -> DegradationPolicy | None:
    """The model's degradation policy, None when it has none."""
    return (
        DegradationPolicy.objects.filter(served_model=served_model)
        .select_related("fallback_model")
        .first()
    )
