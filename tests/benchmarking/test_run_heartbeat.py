"""A run keeps beating during a point that outlasts the stale window; a dead one goes silent."""

import json
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import pytest
from django.db import connection
from django.utils import timezone

from benchmarking import services
from benchmarking.models import BenchmarkRun
from tests.support.servers import serving

pytestmark = pytest.mark.django_db(transaction=True)


class _Streams(BaseHTTPRequestHandler):
    """An OpenAI-compatible completions endpoint that streams two tokens at once."""

    def do_POST(self):  # noqa: N802 - the http.server API
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        chunks = [
            {"choices": [{"text": "a"}]},
            {"choices": [{"text": "b"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
        ]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    with serving(_Streams) as url:
        yield url


def queued_run(suite, deployment, endpoint_url):
    return BenchmarkRun.objects.create(
        suite=suite,
        deployment=deployment,
        served_model=deployment.served_model,
        gpu_type=deployment.gpu_pool.gpu_type,
        endpoint_url=endpoint_url,
        engine_model_id=deployment.served_model.engine_model_id,
        progress_total=len(suite.grid),
    )


def test_a_point_longer_than_the_stale_window_keeps_its_run_alive_through_a_reaper_pass(
    engine, deployment, settings
):
    # Beats every 1/3 s. A 1 s window was once missed beside the niced pass (a starved
    # beat reaped the live run too); 2 s still takes three windows in a 6 s point.
    settings.BENCHMARK_STALE_AFTER_SECONDS = 2
    # One point of 6 s: three stale windows with no point finished.
    suite = services.suite_create(
        name="one-long-point",
        grid=[[4, 2]],
        slo_ttft_p95_ms=2000,
        slo_tpot_p95_ms=2000,
        duration_per_point_seconds=6,
        concurrency_start=1,
        max_concurrency=1,
    )
    live = queued_run(suite, deployment, engine)
    dead = queued_run(suite, deployment, "http://127.0.0.1:9")
    services.run_claim(run_id=dead.pk)  # its worker then stopped
    BenchmarkRun.objects.filter(pk=dead.pk).update(
        heartbeat_at=timezone.now() - timedelta(seconds=30)
    )

    reaped = []

    def reaper_pass_mid_point():
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # once the point has run past the window
                run = BenchmarkRun.objects.get(pk=live.pk)
                if run.started_at and timezone.now() - run.started_at > timedelta(seconds=3):
                    break
                time.sleep(0.05)
            reaped.extend(services.runs_reap_stale())
        finally:
            connection.close()

    reaper = threading.Thread(target=reaper_pass_mid_point)
    reaper.start()
    services.run_execute(run_id=live.pk)
    reaper.join(timeout=30)

    assert reaped == [dead.pk]
    live.refresh_from_db()
    assert live.status == BenchmarkRun.Status.SUCCEEDED, live.error
    assert live.samples.count() == 1
    dead.refresh_from_db()
    assert dead.status == BenchmarkRun.Status.FAILED
    assert "stopped reporting" in dead.error


def test_a_run_ended_during_a_point_stops_measuring_at_the_next_beat(engine, deployment, settings):
    settings.BENCHMARK_STALE_AFTER_SECONDS = 1
    suite = services.suite_create(
        name="ended-mid-point",
        grid=[[4, 2]],
        slo_ttft_p95_ms=2000,
        slo_tpot_p95_ms=2000,
        duration_per_point_seconds=30,
        concurrency_start=1,
        max_concurrency=1,
    )
    run = queued_run(suite, deployment, engine)

    def end_it_after_a_second():
        try:
            time.sleep(1.0)
            services.run_fail(run_id=run.pk, error="cancelled by a planner")
        finally:
            connection.close()

    ender = threading.Thread(target=end_it_after_a_second)
    ender.start()
    started = time.monotonic()
    services.run_execute(run_id=run.pk)
    ender.join(timeout=10)

    assert time.monotonic() - started < 5  # not the 30 s of the point
    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.FAILED
    assert run.error == "cancelled by a planner"
