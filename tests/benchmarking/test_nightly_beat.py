"""End to end (issue 21): the beat row a planner's tick of `benchmark_nightly` writes really
fires a run. Real Celery beat on the django-celery-beat database scheduler, a real worker on
the benchmarks queue, the engine emulator as the endpoint; the row's crontab (02:00 UTC) is
swapped for a two-second interval so the test need not wait for the night."""

import time

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from benchmarking.models import BenchmarkRun
from benchmarking.services import suite_create
from tests.support.processes import celery_beat_process, celery_worker_process, emulator_process

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgresql_only,
    # The run it fires judges its own client's overhead on the TTFT it measures (over 10 %: not
    # fitted), which another worker's load would change.
    pytest.mark.serial,
]

ENGINE = {
    "replicas": 1,
    "max_num_seqs": 16,
    "kv_cache_tokens": 100_000,
    "context_length": 8192,
    "prefill_seconds_per_token": 1.0e-5,
    "decode_step_base_seconds": 2.0e-3,
    "decode_seconds_per_sequence": 5.0e-5,
    "decode_seconds_per_context_token": 1.0e-7,
}
EVERY_SECONDS = 2


def wait_for(predicate, *, timeout_seconds: float, what: str):
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout_seconds} s")


def test_beat_fires_the_row_a_tick_of_the_flag_wrote_and_a_worker_runs_it(
    planner_client, deployment, tmp_path, monkeypatch
):
    # The worker's own judgement of its client's overhead is not what this test is about: on
    # an emulator whose first token takes a few ms, 0.4 ms of event-loop lag is over 10 %, and
    # the run would be refused a fit for that before the fit could say one shape is too few
    # (test_client_overhead.py tests the judgement). The worker reads its settings from the
    # environment it is started with.
    monkeypatch.setenv("BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT", "1000000")
    suite = suite_create(
        name="nightly",
        grid=[[64, 16]],
        slo_ttft_p95_ms=5000,
        slo_tpot_p95_ms=1000,
        duration_per_point_seconds=0.5,
        concurrency_start=1,
        max_concurrency=1,
        request_timeout_seconds=10,
    )
    began = time.monotonic()
    engine = ENGINE | {"name": deployment.served_model.engine_model_id}
    with emulator_process({"seed": 3, "models": [engine]}, tmp_path) as url:
        response = planner_client.patch(
            f"/api/v1/deployments/{deployment.name}/",
            {"endpoint_url": url, "benchmark_suite": suite.name, "benchmark_nightly": True},
            format="json",
        )
        assert response.status_code == 200, response.json()
        row = PeriodicTask.objects.get(task="benchmarking.benchmark_deployment")
        assert (row.enabled, row.crontab.hour) == (True, "2")
        # The short schedule: the same row (task, arguments, queue as the tick wrote them),
        # due every two seconds instead of at 02:00 UTC.
        row.crontab = None
        row.interval, _ = IntervalSchedule.objects.get_or_create(
            every=EVERY_SECONDS, period=IntervalSchedule.SECONDS
        )
        row.save()

        with celery_worker_process(tmp_path, queues="benchmarks"), celery_beat_process(tmp_path):
            run = wait_for(
                lambda: BenchmarkRun.objects.filter(
                    deployment=deployment, started_at__isnull=False
                ).first(),
                timeout_seconds=25,
                what="beat fired no run that a worker started",
            )
        run = wait_for(
            lambda: BenchmarkRun.objects.filter(pk=run.pk, finished_at__isnull=False).first(),
            timeout_seconds=10,
            what="the run did not end",
        )
    print(f"nightly row → beat → worker → run ended in {time.monotonic() - began:.1f} s")

    # Beat itself says it sent this row's task (it writes back when it stops).
    assert PeriodicTask.objects.get(pk=row.pk).total_run_count >= 1
    assert run.suite == suite
    assert run.endpoint_url == url
    assert run.status == BenchmarkRun.Status.SUCCEEDED, run.error + run.log
    assert run.samples.filter(sustainable=True).count() == 1
    # One shape is too few to fit: the run says so, and no version is recorded.
    assert "distinct (input, output) shapes" in run.fit_error
