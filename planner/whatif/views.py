"""What-if: simulate a model's fleet over a trace with changed reservations, overcommit or
policy settings (a Celery job, simulation.whatif), then compare the policies."""

from typing import Any

from django.contrib import messages
from django.core.paginator import Page
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from capacity.models import ServedModel
from capacity.pricing.features import REPLICA_MU_PER_MINUTE
from core.bounds import ascii_whole_number
from core.errors import DomainError
from planner.access import planner_required
from planner.paging import page_of, query_without
from planner.whatif.forms import WhatIfForm
from simulation import from_fleet, whatif
from simulation.models import WhatIfRun

COLUMNS = [
    # key, heading, format
    ("gpu_hours", "GPU-hours", "hours"),
    ("savings_vs_static", "Savings vs static-peak", "percent"),
    ("slo_attainment", "SLO attainment", "percent"),
    ("refused_guaranteed_share", "Refused: guaranteed", "share"),
    ("refused_best_effort_share", "Refused: best-effort", "share"),
    ("guaranteed_slo_attainment", "SLO: admitted guaranteed", "percent"),
    ("ttft_p50_ms", "TTFT p50 (ms)", "ms"),
    ("ttft_p95_ms", "TTFT p95 (ms)", "ms"),
    ("ttft_p99_ms", "TTFT p99 (ms)", "ms"),
    ("tpot_p95_ms", "TPOT p95 (ms)", "ms1"),
    ("guaranteed_refused", "Guaranteed refused", "count"),
    ("scale_events", "Scale events", "count"),
    # Over static-slo (both searched policies run): 100 % is oracle-slo's.
    ("oracle_slo_savings_share", "Share of oracle-slo's saving", "percent"),
]


FORMATS = {
    "hours": "{:,.3f}",
    "percent": "{:.1%}",
    "share": "{:.2%}",
    "ms": "{:,.0f}",
    "ms1": "{:,.1f}",
    "count": "{:,}",
}


def _cell(value: float | None, kind: str) -> str:
    return "—" if value is None else FORMATS[kind].format(value)


def _usd(value: float | None) -> str:
    return "—" if value is None else f"${value:,.2f}"


def _initial_for(request: HttpRequest) -> dict[str, Any]:
    """?model=<id> starts from that model's fleet: its reservations in term (per customer),
    overcommit and keep-warm, and the target utilisation of its deployment on the reference
    GPU type. The deployment field stays blank (every deployment of the model) unless the
    model has only the one."""
    model_id = ascii_whole_number(request.GET.get("model", ""))
    if model_id is None:
        return {}
    served_model = ServedModel.objects.filter(pk=model_id).first()
    if served_model is None:
        return {}
    reservations, keep_warm = from_fleet.reservations_of(served_model, now=timezone.now())
    initial = {
        "served_model": served_model,
        "overcommit": served_model.overcommit,
        "reservations": whatif.format_reservations(reservations),
        "keep_warm": keep_warm,
    }
    try:
        fleet = from_fleet.fleet_of(served_model)
    except DomainError:
        return initial  # the form says why when it is sent
    initial["target_utilisation"] = fleet.deployment.target_utilisation
    if len(fleet.members) == 1 and not fleet.skipped:
        initial["deployment"] = fleet.deployment  # its only one: the same fleet, named
    return initial


def _runs_page(request: HttpRequest) -> Page[WhatIfRun]:
    runs = (
        WhatIfRun.objects.select_related("served_model", "requested_by")
        .defer("trace_csv")
        .order_by("-created_at", "-id")
    )
    page = page_of(request, runs)
    for run in page:
        run.best = whatif.best_policy(run)  # type: ignore[attr-defined]  # for the template only
    return page


@planner_required
def index(request: HttpRequest) -> HttpResponse:
    """The what-if form (from a model's fleet with `?model=`) and the runs; POST queues one."""
    if request.method == "POST":
        form = WhatIfForm(request.POST, request.FILES)
        if form.is_valid():
            data = form.cleaned_data
            upload = data["trace_file"]
            try:
                run = whatif.whatif_create(
                    requested_by=request.user,
                    served_model=data["served_model"],
                    deployment=data["deployment"],
                    trace_name=data["trace"],
                    usage_days=data["usage_days"],
                    trace_csv=upload.read() if upload else "",
                    trace_filename=upload.name if upload else "",
                    model_config=data["model_config"],
                    policies=data["policies"],
                    reservations=data["reservations"],
                    overcommit=data["overcommit"],
                    keep_warm=data["keep_warm"],
                    duration_minutes=data["duration_minutes"],
                    rate_scale=data["rate_scale"],
                    slo_ttft_ms=data["slo_ttft_ms"],
                    slo_goal=data["slo_goal"],
                    target_utilisation=data["target_utilisation"],
                    cold_start_seconds=data["cold_start_seconds"],
                    tick_seconds=data["tick_seconds"],
                )
            except DomainError as error:
                field = (error.field or "").split(".")[0]
                form.add_error(field if field in form.fields else None, error.message)
            else:
                messages.success(request, f"What-if {run.pk} is queued.")
                return redirect("planner:whatif:detail", pk=run.pk)
        status = 400
    else:
        form = WhatIfForm(initial=_initial_for(request))
        status = 200
    context = {
        "form": form,
        "has_models": ServedModel.objects.exists(),
        "built_in": whatif.BUILT_IN_DESCRIPTION,
        "max_requests": whatif.MAX_REQUESTS,
        "page": _runs_page(request),
        "query": query_without(request),
    }
    return render(request, "planner/whatif/index.html", context, status=status)


def _deployment_rows(run: WhatIfRun, order: list[str]) -> list[dict[str, Any]]:
    """Per policy, each deployment's replica-hours, GPU-hours and cost, then the model's
    totals (runs from before whole-model what-ifs have none)."""
    shares = (run.result or {}).get("deployments") or {}
    fleet = (run.settings or {}).get("fleet") or {}
    kinds = {
        row["name"]: f"{row['gpu_type']}×{row['gpus_per_replica']}"
        for row in fleet.get("deployments", [])
    }
    policies = run.result["policies"] if run.result else {}
    rows = []
    for policy in order:
        if policy not in shares:
            continue
        for name, share in shares[policy].items():
            rows.append(
                {
                    "policy": policy,
                    "deployment": name,
                    "kind": kinds.get(name, ""),
                    "cells": [
                        _cell(share.get("replica_hours"), "hours"),
                        _cell(share.get("gpu_hours"), "hours"),
                        _usd(share.get("cost_usd")),
                    ],
                }
            )
        total = policies.get(policy, {})
        rows.append(
            {
                "policy": policy,
                "deployment": "model total",
                "kind": "",
                "total": True,
                "cells": [
                    _cell(
                        sum(s.get("replica_hours") or 0 for s in shares[policy].values()), "hours"
                    ),
                    _cell(total.get("gpu_hours"), "hours"),
                    _usd(total.get("cost_usd")),
                ],
            }
        )
    return rows


def _run_context(run: WhatIfRun) -> dict[str, Any]:
    rows = []
    order: list[str] = []
    best = whatif.best_policy(run)
    if run.result:
        results = run.result["policies"]
        # The settings keep the order compare ran them in (static-peak first); jsonb does not.
        order = [name for name in run.settings.get("policies", []) if name in results]
        order += sorted(set(results) - set(order))
        for name in order:
            values = results[name]
            rows.append(
                {
                    "policy": name,
                    "best": name == best,
                    "cells": [_cell(values.get(key), kind) for key, _, kind in COLUMNS],
                }
            )
    settings = run.settings
    return {
        "run": run,
        "rows": rows,
        "deployment_rows": _deployment_rows(run, order),
        "columns": [heading for _, heading, _ in COLUMNS],
        "best": best,
        "slo_goal_percent": f"{settings.get('slo_goal', 0) * 100:g} %",
        "slo_ttft_ms": settings.get("slo_ttft_ms"),
    }


def _duration(seconds: float) -> str:
    """A duration in the unit that reads best: 7 ms, 60 µs, 50 ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _step_times(model_config: dict[str, Any]) -> str:
    """The simulated replica's step, as the profile times it (simulation.engine.profile)."""
    if not model_config:
        return ""
    return (
        f"{_duration(model_config['decode_step_base_seconds'])} + "
        f"{_duration(model_config['decode_seconds_per_sequence'])} per sequence + "
        f"{_duration(model_config['decode_seconds_per_context_token'])} per context token, "
        f"and {_duration(model_config['prefill_seconds_per_token'])} per prompt token prefilled"
    )


def _trace_label(run: WhatIfRun) -> str:
    settings = run.settings
    if settings.get("trace_source") == whatif.USAGE_TRACE:
        days = settings.get("usage_days")
        model = run.served_model.name if run.served_model else "the model"
        return (
            f"{model}'s own usage of the {days} day{'s' * (days != 1)} before it was queued, "
            f"{settings.get('usage_events', 0):,} usage events"
        )
    if run.trace_name in whatif.BUNDLED_TRACES:
        return whatif.BUNDLED_TRACES[run.trace_name].label
    return f"uploaded {run.trace_filename}"


@planner_required
def detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One what-if: its settings, and per policy its cost and service (while it runs, its
    progress)."""
    run = get_object_or_404(
        WhatIfRun.objects.select_related("served_model", "requested_by").defer("trace_csv"), pk=pk
    )
    settings = run.settings
    reserved = sum((settings.get("reservations") or {}).values())
    context = _run_context(run) | {
        "reservations": sorted((settings.get("reservations") or {}).items()),
        "reserved_total": reserved,
        "model_config": settings.get("model_config"),
        "fleet": settings.get("fleet"),
        # Whole-model what-ifs keep each deployment (older runs: the one their keys describe).
        "deployments": (settings.get("fleet") or {}).get("deployments") or [],
        "step_times": _step_times(settings.get("model_config") or {}),
        # Runs from before fleets were simulated keep their only cap in max_replicas.
        "overcommit_cap": settings.get("overcommit_max_replicas", settings.get("max_replicas")),
        "replica_mu_per_minute": (settings.get("fleet") or {}).get(
            "replica_mu_per_minute", REPLICA_MU_PER_MINUTE
        ),
        "built_in": whatif.BUILT_IN_DESCRIPTION,
        "trace_label": _trace_label(run),
    }
    return render(request, "planner/whatif/detail.html", context)


@planner_required
def progress(request: HttpRequest, pk: int) -> HttpResponse:
    """The htmx fragment the detail page polls every 2 s until the run has finished."""
    run = get_object_or_404(WhatIfRun.objects.defer("trace_csv"), pk=pk)
    return render(request, "planner/whatif/_run.html", _run_context(run))
