"""Benchmarks: runs (live while they measure), their samples and log; cost models per (model,
GPU type, GPUs per replica) with the fit chart, the coefficient history, the price review of a
version that is not in force (its change per customer and per shape against the active one),
activate / reject / retire and "Run now".

Every write goes through the services the API uses (benchmarking.services.run_queue,
capacity.repricing.services.cost_model_activate / cost_model_reject / cost_model_retire); a
refusal (DomainError) is shown as a message on the page, never as a server error.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from benchmarking.models import BenchmarkRun, BenchmarkSample
from benchmarking.selectors import (
    any_suites,
    cost_models_fitted_from,
    latest_runs_of_group,
    runs_without_log,
    samples_in_shape_order,
    sustainable_samples_of_run,
)
from benchmarking.selectors import runs as benchmark_runs
from benchmarking.services import run_queue
from capacity.catalog.selectors import any_deployments_of_group, deployments_of_group
from capacity.models import CostModel, Deployment, GpuType, ServedModel
from capacity.pricing.features import Shape, predict_replica_seconds
from capacity.pricing.review import BENCHMARK_SHAPES, TRAFFIC, PriceChange, signed_percent
from capacity.pricing.selectors import (
    active_cost_models_of_groups,
    cost_model_groups,
    cost_model_versions,
    cost_models_with_model_and_gpu,
    group_has_active_version,
    reference_gpu_has_active_version,
    unfitted_deployment_groups,
)
from capacity.repricing.services import (
    cost_model_activate,
    cost_model_price_change,
    cost_model_reject,
    cost_model_retire,
)
from core.audit import entries_about
from core.errors import DomainError
from planner.access import planner_required
from planner.benchmarks.forms import DecisionForm, RunNowForm
from planner.charts import PALETTE, ChartConfig, line_chart, scatter_chart
from planner.paging import page_of, query_without

UNFINISHED = (BenchmarkRun.Status.QUEUED, BenchmarkRun.Status.RUNNING)
LOG_TAIL_LINES = 80
POLL_TRIGGER = "every 2s"


def sig(value: float | None, digits: int = 4) -> str:
    """A coefficient for people: four significant digits, whatever its magnitude."""
    if value is None:
        return "—"
    return f"{value:.{digits}g}"


def percent(value: float | None) -> str:
    """A share as a percentage with one decimal, or a dash for none."""
    return "—" if value is None else f"{value * 100:.1f} %"


def cost_model_url(
    served_model: ServedModel, gpu_type_id: int, gpus_per_replica: int, version: int | None = None
) -> str:
    """The page of a cost model (model, GPU type, GPUs per replica), at a version if given."""
    url = reverse(
        "planner:benchmarks:cost_model",
        args=[served_model.name, gpu_type_id, gpus_per_replica],
    )
    return f"{url}?version={version}" if version is not None else url


# --- Runs ------------------------------------------------------------------------------------


def _runs_context(request: HttpRequest) -> dict[str, Any]:
    page = page_of(request, runs_without_log())
    runs = list(page.object_list)
    for run in runs:
        # For the template only: the link to the cost model the run measures for.
        run.cost_model_url = cost_model_url(  # type: ignore[attr-defined]
            run.served_model, run.gpu_type_id, run.gpus_per_replica
        )
    return {
        "page": page,
        "runs": runs,
        "query": query_without(request),
        "live": any(run.status in UNFINISHED for run in runs),
        "poll_trigger": POLL_TRIGGER,
        "table_url": reverse("planner:benchmarks:runs_table") + _query_string(request),
    }


def _query_string(request: HttpRequest) -> str:
    query = request.GET.urlencode()
    return f"?{query}" if query else ""


@planner_required
def runs(request: HttpRequest) -> HttpResponse:
    """Every benchmark run, newest first (the table refreshes itself while one is live)."""
    return render(request, "planner/benchmarks/runs.html", _runs_context(request))


@planner_required
def runs_table(request: HttpRequest) -> HttpResponse:
    """The runs table alone: what the list page polls while a shown run is unfinished."""
    return render(request, "planner/benchmarks/_runs_table.html", _runs_context(request))


def _run_or_404(pk: int) -> BenchmarkRun:
    return get_object_or_404(benchmark_runs(), pk=pk)


def _run_live_context(run: BenchmarkRun) -> dict[str, Any]:
    samples = list(samples_in_shape_order(run))
    log_lines = run.log.splitlines()
    return {
        "run": run,
        "samples": samples,
        "sustainable_count": sum(1 for sample in samples if sample.sustainable),
        "log_tail": "\n".join(log_lines[-LOG_TAIL_LINES:]),
        "log_lines": len(log_lines),
        "log_tail_lines": LOG_TAIL_LINES,
        "live": run.status in UNFINISHED,
        "poll_trigger": POLL_TRIGGER,
        "cost_models": [
            {
                "cost_model": cost_model,
                "url": cost_model_url(
                    run.served_model,
                    cost_model.gpu_type_id,
                    cost_model.gpus_per_replica,
                    cost_model.version,
                ),
                "cv_mape": percent(cost_model.cv_mape),
            }
            for cost_model in cost_models_fitted_from(run)
        ],
        "group_url": cost_model_url(run.served_model, run.gpu_type_id, run.gpus_per_replica),
    }


@planner_required
def run_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One run: its status, samples, log, and the cost models fitted from it."""
    return render(request, "planner/benchmarks/run_detail.html", _run_live_context(_run_or_404(pk)))


@planner_required
def run_live(request: HttpRequest, pk: int) -> HttpResponse:
    """Status, progress, samples and log of one run: what its page polls until it ends."""
    return render(request, "planner/benchmarks/_run_live.html", _run_live_context(_run_or_404(pk)))


# --- Cost models overview ------------------------------------------------------------------------


@planner_required
def cost_models(request: HttpRequest) -> HttpResponse:
    """Every cost model with its active version, and the deployments no version covers."""
    page = page_of(request, cost_model_groups())
    active = active_cost_models_of_groups(
        [(g["served_model_id"], g["gpu_type_id"], g["gpus_per_replica"]) for g in page.object_list]
    )
    rows = []
    for group in page.object_list:
        key = (group["served_model_id"], group["gpu_type_id"], group["gpus_per_replica"])
        current = active.get(key)
        rows.append(
            {
                "model_name": group["served_model__name"],
                "gpu_name": group["gpu_type__name"],
                "gpus_per_replica": group["gpus_per_replica"],
                "versions": group["versions"],
                "latest_version": group["latest_version"],
                "waiting_version": group["waiting_version"],
                "active": current,
                "alpha": sig(current.alpha_mu_per_input_token) if current else None,
                "beta": sig(current.beta_mu_per_output_token) if current else None,
                "gamma": sig(current.gamma_mu_per_request) if current else None,
                "cv_mape": percent(current.cv_mape) if current else None,
                "url": reverse(
                    "planner:benchmarks:cost_model",
                    args=[
                        group["served_model__name"],
                        group["gpu_type_id"],
                        group["gpus_per_replica"],
                    ],
                ),
            }
        )
    context = {
        "page": page,
        "rows": rows,
        "query": query_without(request),
        "unfitted": _unfitted_groups(),
    }
    return render(request, "planner/benchmarks/cost_models.html", context)


UNFITTED_SHOWN = 100


def _unfitted_groups() -> list[dict[str, Any]]:
    """(model, GPU type, GPUs per replica) of deployments that no cost model version covers:
    where "Run now" gets a model its first version."""
    groups = unfitted_deployment_groups(limit=UNFITTED_SHOWN)
    return [
        {
            "model_name": group["served_model__name"],
            "gpu_name": group["gpu_pool__gpu_type__name"],
            "gpus_per_replica": group["gpus_per_replica"],
            "deployments": group["deployments"],
            "url": reverse(
                "planner:benchmarks:cost_model",
                args=[
                    group["served_model__name"],
                    group["gpu_pool__gpu_type_id"],
                    group["gpus_per_replica"],
                ],
            ),
        }
        for group in groups
    ]


# --- One cost model: fit chart, history, activate / retire, run now --------------------------


# How the per-feature held-out errors are labelled beside the overall one.
FEATURE_ERROR_LABELS = {
    "cached_input_tokens": "shapes with prefix-cache hits",
    "images": "shapes with images",
}


def feature_errors(cost_model: CostModel) -> list[dict[str, Any]]:
    """The fit's held-out error over the samples with each reported feature (fitting's
    `cv_error_by_feature`), for the features the benchmark varied."""
    return [
        {
            "feature": name,
            "label": FEATURE_ERROR_LABELS.get(name, name),
            "cv_mape": percent(report["cv_mape"]),
            "cv_worst_error": percent(report["cv_worst_error"]),
            "samples": report["samples"],
        }
        for name, report in (cost_model.cv_error_by_feature or {}).items()
    ]


def sample_shape(sample: BenchmarkSample) -> Shape:
    """The shape a sample was fitted as (benchmarking.services.cost_model_fit): input_len counts
    every prompt token, of which cached_input_len hit the prefix cache."""
    return Shape(
        input_tokens=sample.input_len - sample.cached_input_len,
        output_tokens=sample.output_len,
        cached_input_tokens=sample.cached_input_len,
        images=sample.images,
    )


def fit_points(cost_model: CostModel, samples: Iterable[BenchmarkSample]) -> list[dict[str, Any]]:
    """Predicted against measured requests/s per replica, for the samples the fit used."""
    points = []
    for sample in samples:
        try:
            shape = sample_shape(sample)
        except ValueError:
            continue  # more cached than input tokens: not a shape (nor one the fit could use)
        replica_seconds = predict_replica_seconds(cost_model.weights_replica_seconds, shape)
        if not replica_seconds > 0:
            continue  # a shape the model prices at nothing has no predicted throughput
        predicted = 1.0 / replica_seconds
        error = (predicted - sample.requests_per_s) / sample.requests_per_s
        points.append(
            {
                "sample": sample,
                "measured": sample.requests_per_s,
                "predicted": predicted,
                "error": error,
                "error_text": f"{error * 100:+.1f} %" if abs(error) >= 0.0005 else "0.0 %",
            }
        )
    return points


def nice_bound(value: float, *, up: bool) -> float:
    """The nearest 1, 2 or 5 × 10ⁿ above (or below) value: log-axis ends that read cleanly."""
    exponent = math.floor(math.log10(value))
    steps = [m * 10.0**e for e in (exponent - 1, exponent, exponent + 1) for m in (1, 2, 5)]
    if up:
        return min(step for step in steps if step >= value)
    return max(step for step in steps if step <= value)


def fit_chart(points: list[dict[str, Any]]) -> ChartConfig:
    """Predicted against measured throughput of the fit's points, on log axes, with the line
    where they are equal."""
    measured = [point["measured"] for point in points]
    predicted = [point["predicted"] for point in points]
    low = nice_bound(min(measured + predicted) / 1.2, up=False)
    high = nice_bound(max(measured + predicted) * 1.2, up=True)
    config = scatter_chart(
        [
            {
                "label": "Sustainable samples",
                "data": [
                    {
                        "x": round(point["measured"], 6),
                        "y": round(point["predicted"], 6),
                        "shape": f"{point['sample'].input_len}/{point['sample'].output_len}",
                    }
                    for point in points
                ],
            },
            {
                "type": "line",
                "label": "predicted = measured",
                "data": [{"x": low, "y": low}, {"x": high, "y": high}],
                "borderColor": "#9ca3af",
                "backgroundColor": "#9ca3af",
                "borderDash": [6, 4],
                "pointRadius": 0,
                "borderWidth": 1,
            },
        ],
        x_title="Measured requests/s per replica (log)",
        y_title="Predicted requests/s per replica (log)",
    )
    # Throughputs span orders of magnitude and the fit minimises relative error, so both axes
    # are logarithmic: equal distances from the diagonal are equal relative errors.
    for axis in ("x", "y"):
        scale = config["options"]["scales"][axis]
        scale.pop("beginAtZero", None)
        scale.update({"type": "logarithmic", "min": low, "max": high})
    return config


def history_chart(versions: Sequence[CostModel]) -> ChartConfig | None:
    """α, β and γ of each version, on a log axis; None without versions."""
    if not versions:
        return None

    def positive(value: float | None) -> float | None:
        return value if value and value > 0 else None

    config = line_chart(
        [f"v{cost_model.version}" for cost_model in versions],
        [
            {
                "label": "α MU per input token",
                "data": [positive(c.alpha_mu_per_input_token) for c in versions],
                "color": PALETTE[0],
                "pointRadius": 3,
            },
            {
                "label": "β MU per output token",
                "data": [positive(c.beta_mu_per_output_token) for c in versions],
                "color": PALETTE[1],
                "pointRadius": 3,
            },
            {
                "label": "γ MU per request",
                "data": [positive(c.gamma_mu_per_request) for c in versions],
                "color": PALETTE[2],
                "pointRadius": 3,
            },
        ],
        y_title="MU (log)",
        x_title="Version",
    )
    # α, β and γ differ by orders of magnitude: a log axis shows all three moving.
    config["options"]["scales"]["x"]["offset"] = True
    y = config["options"]["scales"]["y"]
    y.pop("beginAtZero", None)
    y["type"] = "logarithmic"
    return config


def _group(model: str, gpu_type: int) -> tuple[ServedModel, GpuType]:
    served_model = get_object_or_404(ServedModel, name=model)
    gpu = get_object_or_404(GpuType, pk=gpu_type)
    return served_model, gpu


def _group_deployments(served_model: ServedModel, gpu: GpuType, gpus: int) -> QuerySet[Deployment]:
    """Deployments whose runs fit this cost model: this model on this GPU type and size."""
    return deployments_of_group(served_model=served_model, gpu_type=gpu, gpus_per_replica=gpus)


@planner_required
def cost_model(request: HttpRequest, model: str, gpu_type: int, gpus: int) -> HttpResponse:
    """One cost model: its versions (`?version=` selects one), the fit and history charts,
    the price review of a version not in force, and "Run now"."""
    served_model, gpu = _group(model, gpu_type)
    versions = cost_model_versions(served_model=served_model, gpu_type=gpu, gpus_per_replica=gpus)
    selected = None
    wanted = request.GET.get("version")
    if wanted:
        selected = next((c for c in versions if str(c.version) == wanted), None)
        if selected is None:
            raise Http404(f"No version {wanted} of this cost model.")
    if selected is None and versions:
        active = [c for c in versions if c.status == CostModel.Status.ACTIVE]
        selected = active[0] if active else versions[-1]

    points = []
    if selected is not None and selected.source_run_id:
        points = fit_points(selected, sustainable_samples_of_run(selected.source_run_id))
    chart = fit_chart(points) if points else None
    in_sample_mape = sum(abs(point["error"]) for point in points) / len(points) if points else None

    version_rows = [
        {
            "cost_model": c,
            "alpha": sig(c.alpha_mu_per_input_token),
            "beta": sig(c.beta_mu_per_output_token),
            "gamma": sig(c.gamma_mu_per_request),
            "cv_mape": percent(c.cv_mape),
            "cv_by_feature": feature_errors(c),
            "url": cost_model_url(served_model, gpu.pk, gpus, c.version),
            "selected": c == selected,
        }
        for c in reversed(versions)
    ]
    deployments = _group_deployments(served_model, gpu, gpus)
    review = None
    if selected is not None and selected.status != CostModel.Status.ACTIVE:
        review = review_context(selected, cost_model_price_change(cost_model=selected), gpu)
    context = {
        "served_model": served_model,
        "gpu": gpu,
        "gpus": gpus,
        "versions": version_rows,
        "selected": selected,
        "selected_row": next((row for row in version_rows if row["selected"]), None),
        "points": points,
        "in_sample_mape": percent(in_sample_mape) if in_sample_mape is not None else None,
        "fit_chart": chart,
        "history_chart": history_chart(versions) if len(versions) > 1 else None,
        "form": RunNowForm(deployments=deployments),
        "has_deployments": any_deployments_of_group(
            served_model=served_model, gpu_type=gpu, gpus_per_replica=gpus
        ),
        "has_suites": any_suites(),
        "run_now_url": reverse(
            "planner:benchmarks:run_now", args=[served_model.name, gpu.pk, gpus]
        ),
        "review": review,
        # Two forms on one page: their fields need distinct ids.
        "activate_form": DecisionForm(auto_id="activate-%s"),
        "reject_form": DecisionForm(auto_id="reject-%s"),
        "history": entries_about(("capacity.costmodel", [c.pk for c in versions]), limit=20),
        "latest_runs": latest_runs_of_group(
            served_model=served_model, gpu_type=gpu, gpus_per_replica=gpus, limit=5
        ),
    }
    return render(request, "planner/benchmarks/cost_model.html", context)


REVIEW_CUSTOMERS_SHOWN = 100


def review_context(
    cost_model: CostModel, change: PriceChange | None, gpu: GpuType
) -> dict[str, Any]:
    """The price review of a version not in force, in words: per customer "this version would
    change acme's usage charge by +7.2 % on last week's traffic", and per shape bucket; for a
    candidate, what it was measured from when it was fitted and who was over the limit."""
    fitted = fitted_review(cost_model) if cost_model.status == CostModel.Status.CANDIDATE else None
    if change is None:
        return {"change": None, "fitted": fitted}
    # Off the reference GPU type the MU are this GPU's replica time: what its replicas mint.
    what = "usage charge" if change.prices_usage else f"replica time on {gpu.name}"
    on = {
        TRAFFIC: "last week's traffic",
        BENCHMARK_SHAPES: "the benchmark's shapes",
    }.get(change.basis, "a typical request")
    customers = [
        {
            "row": row,
            "sentence": (
                f"This version would change {row.key}'s {what} by {row.change_text} on {on}."
            ),
        }
        for row in change.by_customer[:REVIEW_CUSTOMERS_SHOWN]
    ]
    threshold = settings.COST_MODEL_MAX_AUTO_CHANGE
    return {
        "change": change,
        "what": what,
        "on": on,
        "exceeds": change.exceeds(threshold),
        "threshold": f"{threshold * 100:g} %",
        "customers": customers,
        "more_customers": max(0, len(change.by_customer) - REVIEW_CUSTOMERS_SHOWN),
        "api_url": reverse("cost-model-price-change", args=[cost_model.pk]),
        "fitted": fitted,
    }


def fitted_review(cost_model: CostModel) -> dict[str, Any] | None:
    """The review stored when the version was fitted (capacity.pricing.review
    AutoActivationReview.summary), for the page: the baseline it was measured from, the
    change from it and from the version then active, and the customers over the limit. None
    for a version fitted with nothing active, or before reviews had a baseline."""
    stored = cost_model.price_change or {}
    baseline = stored.get("baseline")
    if not baseline:
        return None
    return {
        "baseline_version": baseline["version"],
        "baseline_why": baseline["why"],
        "baseline_change": signed_percent(baseline["change"]),
        "baseline_is_active": baseline["is_active"],
        "active_version": stored["compared_with_version"],
        "active_change": signed_percent(stored["change"]),
        "threshold": f"{stored['max_change'] * 100:g} %",
        "min_customer_requests": stored["min_customer_requests"],
        "over_limit": [
            row | {"change_text": signed_percent(row["change"])}
            for row in stored["customers_over_limit"]
        ],
    }


@planner_required
@require_POST
def run_now(request: HttpRequest, model: str, gpu_type: int, gpus: int) -> HttpResponse:
    """Queue a benchmark run of a deployment of this cost model's group."""
    served_model, gpu = _group(model, gpu_type)
    back = cost_model_url(served_model, gpu.pk, gpus)
    form = RunNowForm(request.POST, deployments=_group_deployments(served_model, gpu, gpus))
    if not form.is_valid():
        for errors in form.errors.values():
            for error in errors:
                messages.error(request, f"Run not queued: {error}")
        return redirect(back)
    try:
        run = run_queue(
            suite=form.cleaned_data["suite"],
            deployment=form.cleaned_data["deployment"],
            replicas=form.cleaned_data["replicas"],
        )
    except DomainError as error:
        messages.error(request, f"Run not queued: {error.message}")
        return redirect(back)
    messages.success(
        request,
        f"Run {run.pk} queued: {form.cleaned_data['deployment'].name} with suite "
        f"{form.cleaned_data['suite'].name}. It starts when a worker on the benchmarks queue "
        "takes it.",
    )
    return redirect("planner:benchmarks:run_detail", pk=run.pk)


def _version_action(
    request: HttpRequest,
    pk: int,
    action: Callable[..., CostModel],
    done: Callable[[CostModel], str],
) -> HttpResponse:
    cost_model = get_object_or_404(cost_models_with_model_and_gpu(), pk=pk)
    back = cost_model_url(
        cost_model.served_model,
        cost_model.gpu_type_id,
        cost_model.gpus_per_replica,
        cost_model.version,
    )
    label = (
        f"{cost_model.served_model.name} on {cost_model.gpu_type.name}"
        f"×{cost_model.gpus_per_replica} v{cost_model.version}"
    )
    try:
        changed = action(cost_model=cost_model)
    except DomainError as error:
        messages.error(request, f"{label} not changed: {error.message}")
        return redirect(back)
    messages.success(request, f"{label} {done(changed)}")
    return redirect(back)


def _reason(request: HttpRequest) -> str:
    form = DecisionForm(request.POST)
    return form.cleaned_data["reason"] if form.is_valid() else ""


@planner_required
@require_POST
def version_activate(request: HttpRequest, pk: int) -> HttpResponse:
    """The planner approves the version: they are recorded as its approver, with the reason."""
    return _version_action(
        request,
        pk,
        partial(cost_model_activate, reason=_reason(request)),
        lambda c: (
            "is active: prices and capacity use it from now on, and the version that was "
            "active is retired."
        ),
    )


@planner_required
@require_POST
def version_reject(request: HttpRequest, pk: int) -> HttpResponse:
    """The planner turns the version down: it stays on record and never activates itself."""
    return _version_action(
        request,
        pk,
        partial(cost_model_reject, reason=_reason(request)),
        lambda c: "is rejected: it stays on record and never activates itself.",
    )


@planner_required
@require_POST
def version_retire(request: HttpRequest, pk: int) -> HttpResponse:
    """The version leaves service; the message says what that leaves unpriced."""

    def done(cost_model: CostModel) -> str:
        if group_has_active_version(
            served_model_id=cost_model.served_model_id,
            gpu_type_id=cost_model.gpu_type_id,
            gpus_per_replica=cost_model.gpus_per_replica,
        ):
            return "is retired."
        consequence = "deployments on these GPUs are not sold"
        if not reference_gpu_has_active_version(cost_model.served_model):
            consequence += " and metered usage of the model cannot be priced"
        return (
            f"is retired. No version is active now: {consequence} until you activate one "
            "(estimates fall back to the newest candidate)."
        )

    return _version_action(request, pk, cost_model_retire, done)
