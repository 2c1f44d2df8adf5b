"""The planner's Benchmarks pages: runs (live while unfinished), a run's samples and log, cost
models with their fit chart and history, activate / retire and "Run now" — through the Django
test client on the real database."""

import json
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from benchmarking import services
from benchmarking.models import BenchmarkRun, BenchmarkSample
from benchmarking.references import deployment_suite_set
from capacity.models import CostModel
from tests.conftest import make_cost_model
from tests.support.factories import DeploymentFactory, GpuTypeFactory, ServedModelFactory

pytestmark = pytest.mark.django_db

RUNS = "/planner/benchmarks/"
RUNS_TABLE = "/planner/benchmarks/runs/table/"
COST_MODELS = "/planner/benchmarks/cost-models/"
POLLING = 'hx-trigger="every 2s"'

# The "true" engine: 1 ms per uncached input token, 0.2 ms per cached one, 20 ms per output
# token, 50 ms per request (replica-seconds on a saturated replica).
GRID = [
    (128, 128, 0),
    (128, 1024, 0),
    (512, 256, 0),
    (1024, 128, 0),
    (2048, 512, 0),
    (4096, 256, 0),
    (256, 2048, 0),
    (8192, 128, 4096),
]
NOISE = [0.03, -0.02, 0.01, -0.03, 0.02, -0.01, 0.0, 0.02]


def true_replica_seconds(input_len: int, output_len: int, cached: int) -> float:
    return 0.001 * (input_len - cached) + 0.0002 * cached + 0.02 * output_len + 0.05


def measured_run(
    served_model,
    gpu_type,
    *,
    deployment=None,
    status=BenchmarkRun.Status.SUCCEEDED,
    noise=NOISE,
    **fields,
):
    """A run that measured GRID: per shape a sustainable point and an overloaded one that broke
    the SLO, throughput per replica a few percent off the true engine."""
    now = timezone.now()
    finished = status == BenchmarkRun.Status.SUCCEEDED
    values = {
        "served_model": served_model,
        "gpu_type": gpu_type,
        "deployment": deployment,
        "endpoint_url": "http://127.0.0.1:8101",
        "engine_model_id": served_model.engine_model_id,
        "status": status,
        "progress_done": len(GRID) if finished else 3,
        "progress_total": len(GRID),
        "progress_message": "measured every shape" if finished else "512/256 at concurrency 8",
        "started_at": now,
        "heartbeat_at": now,
        "finished_at": now if finished else None,
        "log": "".join(f"2025-01-01 00:00:{i:02d} line {i}\n" for i in range(120)),
    }
    run = BenchmarkRun.objects.create(**(values | fields))
    samples = []
    for (input_len, output_len, cached), off in zip(GRID, noise, strict=True):
        rps = (1 + off) / true_replica_seconds(input_len, output_len, cached)
        common = {
            "run": run,
            "input_len": input_len,
            "output_len": output_len,
            "cached_input_len": cached,
            "ttft_p95_ms": 180.0,
            "request_count": 200,
        }
        samples.append(
            BenchmarkSample(
                **common, concurrency=8, requests_per_s=rps, tpot_p95_ms=31.5, sustainable=True
            )
        )
        samples.append(
            BenchmarkSample(
                **common,
                concurrency=16,
                requests_per_s=rps * 1.02,
                tpot_p95_ms=260.0,
                slo_met=False,
            )
        )
    BenchmarkSample.objects.bulk_create(samples)
    return run


def chart_config(html: str, script_id: str) -> dict:
    match = re.search(rf'<script id="{script_id}" type="application/json">(.*?)</script>', html)
    assert match, f"no chart config {script_id} in the page"
    return json.loads(match.group(1))


def text(response) -> str:
    return response.content.decode()


def cost_model_path(served_model, gpu_type, gpus=1) -> str:
    return f"/planner/benchmarks/cost-models/{served_model.name}/{gpu_type.pk}/{gpus}/"


# --- access and empty states ------------------------------------------------------------------


def test_benchmark_pages_are_for_planners_only(client, member_client):
    assert client.get(RUNS).status_code == 302
    assert "/login/" in client.get(COST_MODELS)["Location"]
    assert member_client.get(RUNS).status_code == 403
    assert member_client.get(COST_MODELS).status_code == 403


def test_empty_pages_say_how_to_get_a_first_run_and_cost_model(planner_client):
    runs = text(planner_client.get(RUNS))
    assert "No benchmark runs yet." in runs
    assert "manage.py import_benchmark" in runs
    assert "manage.py run_benchmark" in runs
    assert "POST /api/v1/benchmark-runs/" in runs
    assert "benchmarks</code> Celery queue" in runs
    cost_models = text(planner_client.get(COST_MODELS))
    assert "No cost models yet." in cost_models
    assert "manage.py fit_cost_model" in cost_models


def test_a_model_without_a_cost_model_or_deployment_says_what_to_do(
    planner_client, served_model, gpu_type
):
    page = text(planner_client.get(cost_model_path(served_model, gpu_type)))
    assert "No cost model for llama-8b on H100-80GB×1 yet." in page
    assert "No deployment of llama-8b on H100-80GB×1 to benchmark." in page
    assert (
        planner_client.get(cost_model_path(served_model, gpu_type, 1) + "?version=3").status_code
        == 404
    )
    assert planner_client.get("/planner/benchmarks/cost-models/nope/1/1/").status_code == 404
    assert planner_client.get("/planner/benchmarks/runs/999/").status_code == 404


# --- runs list and live refresh -------------------------------------------------------------


def test_the_runs_list_shows_runs_newest_first_and_polls_only_while_one_is_unfinished(
    planner_client, served_model, gpu_type, deployment
):
    done = measured_run(
        served_model, gpu_type, source=BenchmarkRun.Source.IMPORT, source_detail="t.csv"
    )
    running = measured_run(
        served_model, gpu_type, deployment=deployment, status=BenchmarkRun.Status.RUNNING
    )
    page = text(planner_client.get(RUNS))
    assert page.index(f"Run {running.pk}<") < page.index(f"Run {done.pk}<")
    assert f'href="/planner/benchmarks/runs/{running.pk}/"' in page
    assert "llama-8b" in page and "H100-80GB ×1" in page and "llama-8b-h100" in page
    assert "import: t.csv" in page
    assert '<span class="badge running">Running</span>' in page
    assert '<span class="badge succeeded">Succeeded</span>' in page
    assert "3/8" in page and "512/256 at concurrency 8" in page and "width: 38%" in page
    assert POLLING in page
    assert POLLING in text(planner_client.get(RUNS_TABLE))

    BenchmarkRun.objects.filter(pk=running.pk).update(
        status=BenchmarkRun.Status.SUCCEEDED, progress_done=8, finished_at=timezone.now()
    )
    fragment = text(planner_client.get(RUNS_TABLE))
    assert fragment.lstrip().startswith('<div id="runs-table"')
    assert "<html" not in fragment
    assert POLLING not in fragment and "hx-get" not in fragment  # the last swap stops polling
    assert fragment.count('<span class="badge succeeded">') == 2


def test_the_runs_list_is_paginated(planner_client, served_model, gpu_type):
    BenchmarkRun.objects.bulk_create(
        BenchmarkRun(served_model=served_model, gpu_type=gpu_type, status="running")
        for _ in range(55)
    )
    first = text(planner_client.get(RUNS))
    assert "Page 1 of 2 (55 in all)" in first
    second = text(planner_client.get(RUNS + "?page=2"))
    assert second.count('<tr id="run-') == 5
    # The polled fragment keeps the page it refreshes.
    assert 'hx-get="/planner/benchmarks/runs/table/?page=2"' in second


# --- run detail ---------------------------------------------------------------------------------


def test_a_run_page_shows_progress_samples_log_errors_and_its_cost_model(
    planner_client, served_model, gpu_type, deployment
):
    run = measured_run(served_model, gpu_type, deployment=deployment)
    cost_model = services.cost_model_fit(run=run)
    page = text(planner_client.get(f"/planner/benchmarks/runs/{run.pk}/"))
    assert f"Run {run.pk}: llama-8b on H100-80GB ×1" in page
    assert 'Samples <span class="muted">(16, 8 sustainable)' in page
    assert page.count('<span class="badge ok">sustainable</span>') == 8
    assert "8/8" in page
    # The log's tail, not its head.
    assert "line 119" in page and "line 39\n" not in page and "last 80 of 120 lines" in page
    version_url = f"{cost_model_path(served_model, gpu_type)}?version={cost_model.version}"
    assert f'href="{version_url}"' in page
    assert POLLING not in page

    BenchmarkRun.objects.filter(pk=run.pk).update(fit_error="need at least 6 distinct shapes")
    failed = measured_run(
        served_model,
        gpu_type,
        status=BenchmarkRun.Status.FAILED,
        error="The worker stopped reporting for over 180 s (killed or lost)",
    )
    assert "No cost model was fitted:</strong> need at least 6 distinct shapes" in text(
        planner_client.get(f"/planner/benchmarks/runs/{run.pk}/")
    )
    assert "The run failed:</strong> The worker stopped reporting" in text(
        planner_client.get(f"/planner/benchmarks/runs/{failed.pk}/")
    )


def test_a_running_run_page_polls_until_the_run_ends(planner_client, served_model, gpu_type):
    run = BenchmarkRun.objects.create(
        served_model=served_model, gpu_type=gpu_type, progress_total=4, progress_message="queued"
    )
    page = text(planner_client.get(f"/planner/benchmarks/runs/{run.pk}/"))
    assert POLLING in page
    assert f'hx-get="/planner/benchmarks/runs/{run.pk}/live/"' in page
    assert "Waiting for a Celery worker" in page and "No samples yet." in page
    BenchmarkRun.objects.filter(pk=run.pk).update(
        status=BenchmarkRun.Status.FAILED, error="endpoint refused connections"
    )
    fragment = text(planner_client.get(f"/planner/benchmarks/runs/{run.pk}/live/"))
    assert POLLING not in fragment
    assert '<span class="badge failed" id="run-status">Failed</span>' in fragment
    assert "endpoint refused connections" in fragment


# --- cost models ----------------------------------------------------------------------------


def test_the_overview_has_one_row_per_model_gpu_and_size_with_the_active_coefficients(
    planner_client, served_model, gpu_type, deployment
):
    active = services.cost_model_fit(run=measured_run(served_model, gpu_type))
    assert active.status == CostModel.Status.ACTIVE
    candidate = make_cost_model(served_model, gpu_type, gpus_per_replica=2)
    CostModel.objects.filter(pk=candidate.pk).update(status=CostModel.Status.CANDIDATE)
    other_gpu = GpuTypeFactory(name="L40S")
    DeploymentFactory(name="llama-8b-l40s", served_model=served_model, gpu_pool__gpu_type=other_gpu)

    page = text(planner_client.get(COST_MODELS))
    assert page.count(f'<a href="{cost_model_path(served_model, gpu_type)}">llama-8b</a>') == 1
    assert f"{active.alpha_mu_per_input_token:.4g}" in page
    assert f"{active.beta_mu_per_output_token:.4g}" in page
    assert f"{active.gamma_mu_per_request:.4g}" in page
    assert f"{active.cv_mape * 100:.1f} %" in page
    assert "none active" in page and "newest: v1" in page  # the ×2 group
    # A deployment no cost model covers is listed, with the way to its first run.
    assert "Deployed but not fitted yet" in page
    assert f'href="{cost_model_path(served_model, other_gpu)}#run-now"' in page


def test_the_fit_chart_plots_the_fits_own_predictions_against_the_measurements(
    planner_client, served_model, gpu_type
):
    run = measured_run(served_model, gpu_type)
    cost_model = services.cost_model_fit(run=run)
    page = text(planner_client.get(cost_model_path(served_model, gpu_type)))
    assert '<canvas id="fit-chart" data-chart="fit-chart-config"' in page
    # Beside the overall held-out error, the error over the shapes with prefix-cache hits.
    cached = cost_model.cv_error_by_feature["cached_input_tokens"]
    assert cached["samples"] == 1
    assert "CV MAPE, shapes with prefix-cache hits (1)" in page
    assert f"{cached['cv_mape'] * 100:.1f} %" in page
    config = chart_config(page, "fit-chart-config")
    points, diagonal = config["data"]["datasets"]
    assert diagonal["label"] == "predicted = measured"
    assert [p["x"] for p in diagonal["data"]] == [p["y"] for p in diagonal["data"]]
    # One point per sustainable sample: measured per replica on x, 1 / the replica-seconds the
    # fit itself predicted for that sample on y (the residuals the fit stored).
    assert len(points["data"]) == 8
    by_shape = {p["shape"]: p for p in points["data"]}
    for residual in cost_model.residuals:
        input_len = residual["input_tokens"] + residual["cached_input_tokens"]
        point = by_shape[f"{input_len}/{residual['output_tokens']}"]
        assert point["y"] == pytest.approx(1 / residual["predicted_replica_seconds"], rel=1e-4)
        assert point["x"] == pytest.approx(1 / residual["measured_replica_seconds"], rel=1e-4)
    assert config["options"]["scales"]["x"]["type"] == "logarithmic"
    assert "In-sample mean error" in page


def test_versions_have_a_history_and_the_selected_version_drives_the_chart(
    planner_client, served_model, gpu_type
):
    run = measured_run(served_model, gpu_type)
    first = services.cost_model_fit(run=run)
    second = services.cost_model_fit(run=run)
    old = make_cost_model(served_model, gpu_type)  # v3: recorded without a source run
    assert (first.version, second.version, old.version) == (1, 2, 3)
    base = cost_model_path(served_model, gpu_type)

    page = text(planner_client.get(base))
    # Default: the active version (v3, the newest fit, activated itself).
    assert 'v3 <span class="badge active">Active</span>' in page
    assert "No fit chart for version 3." in page and "not recorded" in page
    history = chart_config(page, "history-chart-config")
    assert history["data"]["labels"] == ["v1", "v2", "v3"]
    assert [d["label"][0] for d in history["data"]["datasets"]] == ["α", "β", "γ"]
    assert history["data"]["datasets"][2]["data"][2] == pytest.approx(old.gamma_mu_per_request)
    for version in (1, 2, 3):
        assert f'<tr id="version-{version}"' in page

    page = text(planner_client.get(base + "?version=1"))
    assert 'v1 <span class="badge retired">Retired</span>' in page
    assert len(chart_config(page, "fit-chart-config")["data"]["datasets"][0]["data"]) == 8


def test_activate_and_retire_change_the_status_and_a_refusal_is_a_message(
    planner_client, served_model, gpu_type
):
    run = measured_run(served_model, gpu_type)
    first = services.cost_model_fit(run=run)
    second = services.cost_model_fit(run=run)
    first.refresh_from_db()
    assert (first.status, second.status) == ("retired", "active")

    response = planner_client.post(
        f"/planner/benchmarks/cost-model-versions/{first.pk}/activate/", follow=True
    )
    assert response.status_code == 200
    assert response.redirect_chain[-1][0] == cost_model_path(served_model, gpu_type) + "?version=1"
    assert "llama-8b on H100-80GB×1 v1 is active" in text(response)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, second.status) == ("active", "retired")

    response = planner_client.post(
        f"/planner/benchmarks/cost-model-versions/{first.pk}/retire/", follow=True
    )
    assert "v1 is retired. No version is active now" in text(response)
    first.refresh_from_db()
    assert first.status == "retired" and first.retired_at is not None

    # A stale page retires it again: refused, said plainly, nothing breaks.
    response = planner_client.post(
        f"/planner/benchmarks/cost-model-versions/{first.pk}/retire/", follow=True
    )
    assert response.status_code == 200
    assert (
        '<li class="error">llama-8b on H100-80GB×1 v1 not changed: Version 1 is already retired.'
        in text(response)
    )
    assert (
        planner_client.get(
            f"/planner/benchmarks/cost-model-versions/{first.pk}/retire/"
        ).status_code
        == 405
    )
    assert (
        planner_client.post("/planner/benchmarks/cost-model-versions/999/retire/").status_code
        == 404
    )


# --- run now ---------------------------------------------------------------------------------


@pytest.fixture
def suite(db):
    return services.suite_create(
        name="quick",
        grid=[[128, 16], [512, 16], [1024, 64]],
        slo_ttft_p95_ms=2000,
        slo_tpot_p95_ms=200,
    )


def test_run_now_queues_a_run_of_the_deployment_and_opens_it(
    planner_client, served_model, gpu_type, deployment, suite, django_capture_on_commit_callbacks
):
    deployment.endpoint_url = "http://127.0.0.1:8101"
    deployment.save()
    deployment_suite_set(deployment=deployment, suite=suite)
    page = text(planner_client.get(cost_model_path(served_model, gpu_type)))
    assert "llama-8b-h100 (quick; http://127.0.0.1:8101)" in page

    with django_capture_on_commit_callbacks() as callbacks:
        response = planner_client.post(
            cost_model_path(served_model, gpu_type) + "run/",
            {"deployment": deployment.pk, "replicas": 2},
        )
    run = BenchmarkRun.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/planner/benchmarks/runs/{run.pk}/"
    assert (run.status, run.suite, run.deployment, run.progress_total, run.replicas) == (
        "queued",
        suite,
        deployment,
        3,
        2,
    )
    assert len(callbacks) == 1  # the Celery task is sent when the transaction commits

    page = text(planner_client.get(response["Location"]))
    assert f"Run {run.pk} queued: llama-8b-h100 with suite quick." in page
    assert '<span class="badge queued" id="run-status">Queued</span>' in page
    assert POLLING in page


def test_run_now_shows_why_a_run_cannot_be_queued(
    planner_client, served_model, gpu_type, deployment, suite
):
    url = cost_model_path(served_model, gpu_type) + "run/"
    # No endpoint: the service's own words.
    response = planner_client.post(
        url, {"deployment": deployment.pk, "suite": suite.pk, "replicas": 1}, follow=True
    )
    assert response.status_code == 200
    assert (
        '<li class="error">Run not queued: Nothing to benchmark: the deployment has no endpoint_url'
        in text(response)
    )
    # No suite on the deployment and none chosen.
    deployment.endpoint_url = "http://127.0.0.1:8101"
    deployment.save()
    response = planner_client.post(url, {"deployment": deployment.pk, "replicas": 1}, follow=True)
    assert "Deployment llama-8b-h100 has no benchmark suite: choose a suite." in text(response)
    # A deployment of another model is not a choice here.
    elsewhere = DeploymentFactory(endpoint_url="http://127.0.0.1:8102")
    response = planner_client.post(
        url, {"deployment": elsewhere.pk, "suite": suite.pk, "replicas": 1}, follow=True
    )
    assert "Run not queued: Select a valid choice." in text(response)
    response = planner_client.post(
        url, {"deployment": deployment.pk, "suite": suite.pk, "replicas": 0}, follow=True
    )
    assert "Run not queued: Ensure this value is greater than or equal to 1." in text(response)
    assert not BenchmarkRun.objects.exists()


# --- queries do not grow with rows --------------------------------------------------------------


def _grow(count: int) -> None:
    for _ in range(count):
        gpu = GpuTypeFactory()
        model = ServedModelFactory(reference_gpu_type=gpu)
        deployment = DeploymentFactory(served_model=model, gpu_pool__gpu_type=gpu)
        BenchmarkRun.objects.create(
            served_model=model, gpu_type=gpu, deployment=deployment, status="running", log="x" * 100
        )
        make_cost_model(model, gpu)
        make_cost_model(model, gpu, gpus_per_replica=2)
        DeploymentFactory(served_model=model, gpu_pool__gpu_type=GpuTypeFactory())  # unfitted


def _queries(client, path: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, path
    return len(captured)


def test_list_pages_do_not_grow_queries_with_their_rows(planner_client):
    paths = [RUNS, RUNS_TABLE, COST_MODELS]
    _grow(2)
    few = {path: _queries(planner_client, path) for path in paths}
    _grow(7)
    many = {path: _queries(planner_client, path) for path in paths}
    assert many == few
