"""Health: replicas and their probes, fingerprints, incidents with their timed steps, and the
degradation of each model (state, policy, changes). Writes go through
capacity.health.services, like the API's."""

from collections.abc import Iterable

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from capacity.health.selectors import (
    degradation_changes_newest_first,
    degradation_policy_of,
    deployments_with_replicas_by_name,
    ended_incidents_newest_first,
    incidents_with_steps,
    open_incidents_newest_first,
    replica_counts_by_state,
    served_models_with_degradation_by_name,
    served_models_with_degradation_state,
)
from capacity.health.services import (
    degradation_policy_save,
    degradation_rows,
    fingerprint_reset,
    level_in_words,
    seconds_to_ready,
    seconds_to_restart_requested,
    step_timings,
)
from capacity.models import Deployment, Incident
from core.audit import entries_about
from core.errors import DomainError
from planner.access import planner_required
from planner.audit.views import audit_link
from planner.health.forms import PolicyForm
from planner.paging import page_of, query_without

DEPLOYMENTS_PER_PAGE = 20
INCIDENTS_PER_PAGE = 20
CHANGES_PER_PAGE = 20


def _with_timings(incidents: Iterable[Incident]) -> Iterable[Incident]:
    # For the template only: each incident's seconds to restart and to ready.
    for incident in incidents:
        incident.to_restart = seconds_to_restart_requested(incident)  # type: ignore[attr-defined]
        incident.to_ready = seconds_to_ready(incident)  # type: ignore[attr-defined]
    return incidents


@planner_required
def index(request: HttpRequest) -> HttpResponse:
    """Replicas and their probes, open and ended incidents, and each model's degradation."""
    deployments_page = page_of(
        request,
        deployments_with_replicas_by_name(),
        per_page=DEPLOYMENTS_PER_PAGE,
        param="deployments_page",
    )
    open_page = page_of(
        request,
        open_incidents_newest_first(),
        per_page=INCIDENTS_PER_PAGE,
        param="open_page",
    )
    recent_page = page_of(
        request,
        ended_incidents_newest_first(),
        per_page=INCIDENTS_PER_PAGE,
        param="page",
    )
    _with_timings(open_page.object_list)
    _with_timings(recent_page.object_list)
    models_page = page_of(
        request,
        served_models_with_degradation_by_name(),
        param="models_page",
    )
    changes_page = page_of(
        request,
        degradation_changes_newest_first(),
        per_page=CHANGES_PER_PAGE,
        param="changes_page",
    )
    counts = replica_counts_by_state()
    degradation = degradation_rows(models_page.object_list)
    context = {
        "deployments": deployments_page,
        "open_incidents": open_page,
        "recent_incidents": recent_page,
        "models": models_page,
        "degradation": degradation,
        "changes": changes_page,
        "counts": counts,
        "any_replicas": any(counts.values()),
        "degraded_models": sum(1 for row in degradation if row["level"]),
        "probe_interval": settings.HEALTH_PROBE_INTERVAL_SECONDS,
        "probe_failures": settings.HEALTH_PROBE_FAILURES,
        # Each list pages on its own parameter and keeps the others' pages.
        "queries": {
            param: query_without(request, param)
            for param in ("deployments_page", "open_page", "page", "models_page", "changes_page")
        },
        "now": timezone.now(),
    }
    return render(request, "planner/health/index.html", context)


@planner_required
def incident(request: HttpRequest, pk: int) -> HttpResponse:
    """One incident with its timed steps."""
    incident = get_object_or_404(incidents_with_steps(), pk=pk)
    context = {
        "incident": incident,
        "steps": step_timings(incident),
        "to_restart": seconds_to_restart_requested(incident),
        "to_ready": seconds_to_ready(incident),
        "now": timezone.now(),
    }
    return render(request, "planner/health/incident.html", context)


@planner_required
@require_POST
def reset_fingerprint(request: HttpRequest, name: str) -> HttpResponse:
    """Forget the deployment's known-good probe answer: the next good one is recorded."""
    deployment = get_object_or_404(Deployment, name=name)
    forgotten = fingerprint_reset(deployment)
    if forgotten is None:
        messages.info(
            request,
            f"{deployment.name} had no fingerprint: the next good probe answer is recorded.",
        )
    else:
        messages.success(
            request,
            f"Fingerprint of {deployment.name} reset: the next good probe answer "
            f"(instead of {forgotten.answer[:60]!r}) becomes the known-good one.",
        )
    return redirect("planner:health:index")


@planner_required
def policy(request: HttpRequest, name: str) -> HttpResponse:
    """A model's degradation policy, its state and history; POST saves the policy."""
    served_model = get_object_or_404(served_models_with_degradation_state(), name=name)
    current = degradation_policy_of(served_model)
    status = 200
    if request.method == "POST":
        form = PolicyForm(request.POST, served_model=served_model)
        if form.is_valid():
            try:
                _, created = degradation_policy_save(served_model=served_model, **form.cleaned_data)
            except DomainError as error:
                # A refusal of the policy as a whole (no field) goes on the form's top.
                problems = error.fields.items() if error.fields else [(None, [error.message])]
                for field, reasons in problems:
                    for reason in reasons:
                        form.add_error(field if field in form.fields else None, reason)
            else:
                messages.success(
                    request,
                    f"Degradation policy of {served_model.name} "
                    f"{'created' if created else 'saved'}.",
                )
                return redirect(reverse("planner:health:index") + "#degradation")
        status = 400
    elif current is not None:
        form = PolicyForm(
            served_model=served_model,
            initial={
                "enabled": current.enabled,
                "degrade_below": current.degrade_below,
                "recover_at": current.recover_at,
                "window_seconds": current.window_seconds,
                "hysteresis_seconds": current.hysteresis_seconds,
                "max_tokens_cap": current.max_tokens_cap,
                "fallback_model": current.fallback_model,
            },
        )
    else:
        form = PolicyForm(served_model=served_model)
    state = getattr(served_model, "degradation_state", None)
    level = state.level if state else 0
    context = {
        "model": served_model,
        "policy": current,
        "state": state,
        "words": level_in_words(level, current),
        "form": form,
        "history": entries_about(current, limit=20) if current is not None else [],
        "history_link": audit_link(current) if current is not None else "",
    }
    return render(request, "planner/health/policy.html", context, status=status)
