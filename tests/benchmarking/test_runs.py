"""Benchmark runs as rows: queued through the API, failed clearly, never left running."""

from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import pytest
from django.utils import timezone

from benchmarking import services
from benchmarking.models import BenchmarkRun, BenchmarkSample, BenchmarkSuite
from benchmarking.references import deployment_suite_set
from capacity.models import CostModel
from tests.support.servers import serving

pytestmark = pytest.mark.django_db

SUITE = {
    "name": "quick",
    "grid": [[128, 16], [512, 16]],
    "slo_ttft_p95_ms": 2000,
    "slo_tpot_p95_ms": 200,
    "duration_per_point_seconds": 0.5,
    "max_concurrency": 4,
}


@pytest.fixture
def suite(db):
    return services.suite_create(**SUITE)


class _Always500(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server API
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "overloaded"}}')

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_server():
    with serving(_Always500) as url:
        yield url


def test_a_planner_creates_a_suite_and_a_bad_grid_is_named(planner_client):
    response = planner_client.post("/api/v1/benchmark-suites/", SUITE, format="json")
    assert response.status_code == 201, response.json()
    bad = planner_client.post(
        "/api/v1/benchmark-suites/",
        SUITE | {"name": "bad", "grid": [[128, 0], [1]]},
        format="json",
    )
    assert bad.status_code == 400
    assert any(field.startswith("grid") for field in bad.json()["error"]["fields"])
    assert BenchmarkSuite.objects.count() == 1


def test_a_suite_holds_shapes_with_a_shared_prefix_and_images_and_a_bad_share_is_named(
    planner_client,
):
    grid = [
        [128, 32],
        {"input_len": 2048, "output_len": 16, "prefix_share": 0.75},
        {"input_len": 256, "output_len": 8, "images": 2, "prefix_share": 0},
    ]
    response = planner_client.post(
        "/api/v1/benchmark-suites/", SUITE | {"name": "features", "grid": grid}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert BenchmarkSuite.objects.get(name="features").grid == [
        [128, 32],
        {"input_len": 2048, "output_len": 16, "prefix_share": 0.75, "images": 0},
        {"input_len": 256, "output_len": 8, "prefix_share": 0.0, "images": 2},
    ]

    bad = planner_client.post(
        "/api/v1/benchmark-suites/",
        SUITE | {"name": "bad", "grid": [{"input_len": 64, "output_len": 8, "prefix_share": 1}]},
        format="json",
    )
    assert bad.status_code == 400
    assert "grid[0].prefix_share" in bad.json()["error"]["message"]


def test_creating_a_run_queues_it_after_commit(
    planner_client, suite, deployment, django_capture_on_commit_callbacks, monkeypatch
):
    queued = []
    monkeypatch.setattr(services, "_queue_task", queued.append)
    deployment.endpoint_url = "http://127.0.0.1:9/"
    deployment.save()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = planner_client.post(
            "/api/v1/benchmark-runs/",
            {"suite": "quick", "deployment": deployment.name},
            format="json",
        )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued"
    assert body["progress_total"] == 2
    assert len(callbacks) == 1
    assert queued == [body["id"]]


def test_a_run_of_a_deployment_without_an_endpoint_is_refused(planner_client, suite, deployment):
    response = planner_client.post(
        "/api/v1/benchmark-runs/", {"suite": "quick", "deployment": deployment.name}, format="json"
    )
    assert response.status_code == 400
    assert "endpoint_url" in response.json()["error"]["fields"]
    assert not BenchmarkRun.objects.exists()


def _queued_run(suite, deployment, endpoint_url) -> BenchmarkRun:
    return BenchmarkRun.objects.create(
        suite=suite,
        deployment=deployment,
        served_model=deployment.served_model,
        gpu_type=deployment.gpu_pool.gpu_type,
        endpoint_url=endpoint_url,
        engine_model_id=deployment.served_model.engine_model_id,
        progress_total=len(suite.grid),
    )


def test_an_unreachable_endpoint_fails_the_run_with_the_reason(suite, deployment):
    run = _queued_run(suite, deployment, "http://127.0.0.1:9")  # discard port: nothing listens

    services.run_execute(run_id=run.pk)

    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.FAILED
    assert "cannot serve" in run.error
    assert "cannot connect to 127.0.0.1:9" in run.error
    assert run.finished_at is not None
    assert not CostModel.objects.exists()


def test_a_storm_of_5xx_fails_the_run_and_fits_nothing(suite, deployment, failing_server):
    run = _queued_run(suite, deployment, failing_server)

    services.run_execute(run_id=run.pk)

    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.FAILED
    assert "HTTP 503" in run.error
    assert not CostModel.objects.exists()


def test_a_run_is_claimed_once(suite, deployment):
    run = _queued_run(suite, deployment, "http://127.0.0.1:9")
    assert services.run_claim(run_id=run.pk) is True
    assert services.run_claim(run_id=run.pk) is False
    run.refresh_from_db()
    assert run.attempts == 1
    # A redelivered task finds the run taken and leaves it alone.
    assert services.run_execute(run_id=run.pk) is None


def test_a_run_whose_worker_died_is_failed_by_the_reaper_and_never_fitted(suite, deployment):
    run = _queued_run(suite, deployment, "http://127.0.0.1:9")
    services.run_claim(run_id=run.pk)
    BenchmarkSample.objects.create(
        run=run, input_len=128, output_len=16, concurrency=1, requests_per_s=3, sustainable=True
    )
    BenchmarkRun.objects.filter(pk=run.pk).update(
        heartbeat_at=timezone.now() - timedelta(minutes=10)
    )

    assert services.runs_reap_stale(stale_after_seconds=60) == [run.pk]

    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.FAILED
    assert "stopped reporting" in run.error
    with pytest.raises(services.DomainError, match="only a succeeded run is fitted"):
        services.cost_model_fit(run=run)


def test_a_fresh_running_run_is_left_alone_by_the_reaper(suite, deployment):
    run = _queued_run(suite, deployment, "http://127.0.0.1:9")
    services.run_claim(run_id=run.pk)
    assert services.runs_reap_stale(stale_after_seconds=60) == []
    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.RUNNING


def test_setup_periodic_tasks_is_idempotent_and_follows_deployments(suite, deployment):
    from django.core.management import call_command
    from django_celery_beat.models import PeriodicTask

    deployment.benchmark_nightly = True
    deployment.save()
    deployment_suite_set(deployment=deployment, suite=suite)
    call_command("setup_periodic_tasks")
    call_command("setup_periodic_tasks")
    nightly = PeriodicTask.objects.get(name=f"nightly benchmark: {deployment.name}")
    assert nightly.task == "benchmarking.benchmark_deployment"
    assert nightly.enabled
    assert nightly.crontab.hour == "2"
    assert PeriodicTask.objects.filter(name__startswith="nightly benchmark").count() == 1
    assert PeriodicTask.objects.filter(task="benchmarking.reap_stale_runs").count() == 1

    deployment.benchmark_nightly = False
    deployment.save()
    call_command("setup_periodic_tasks")
    nightly.refresh_from_db()
    assert not nightly.enabled
