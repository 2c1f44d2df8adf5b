"""A run whose client adds more than BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT to the TTFT it
measures is marked unreliable and is not fitted: it measured its own client, not the engine.

Provoked for real: an engine faster than any client. It streams its first token at once and
the rest of the completion (thousands of tokens) in one write, so the runner's event loop
spends its time reading streams, every response waits behind it, and the loop's lag is a
large share of the few milliseconds of TTFT the engine takes. The engine keeps vLLM's
counters on /metrics, as the runner expects of a real one."""

import asyncio
import json
import threading
import time

import pytest
from aiohttp import web

from benchmarking import services
from benchmarking.models import BenchmarkRun
from capacity.models import CostModel
from tests.support.factories import GpuTypeFactory, ServedModelFactory
from tests.support.processes import free_port

# Measures the client's own lag against real latencies: runs alone.
pytestmark = [pytest.mark.serial, pytest.mark.django_db]

TOKEN = b'data: {"choices":[{"index":0,"text":" tok"}]}\n\n'
# Six shapes, both lengths varying: enough for a fit (benchmarking.fitting).
GRID = [[16, 2000], [32, 3000], [64, 4000], [16, 3000], [32, 4000], [64, 2000]]
SUITE = {
    "slo_ttft_p95_ms": 10_000,
    "slo_tpot_p95_ms": 1_000,
    "duration_per_point_seconds": 0.3,
    "concurrency_start": 4,
    "max_concurrency": 4,
    "request_timeout_seconds": 10,
}


class _FloodingEngine:
    """An OpenAI-compatible completions endpoint that decodes instantly, with vLLM's
    request_success counter and TTFT histogram (measured from the request's arrival)."""

    def __init__(self) -> None:
        self.finished = 0
        self.ttft_seconds_sum = 0.0
        self.ttft_count = 0
        self.url = ""
        self._ready = threading.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        arrived = time.perf_counter()
        tokens = body["max_tokens"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(TOKEN)
        self.ttft_seconds_sum += time.perf_counter() - arrived
        self.ttft_count += 1
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
        await response.write(
            TOKEN * (tokens - 1)
            + f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            + b"data: [DONE]\n\n"
        )
        self.finished += 1
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        labels = 'model_name="flood"'
        return web.Response(
            text="# TYPE vllm:request_success_total counter\n"
            f"vllm:request_success_total{{{labels}}} {self.finished}\n"
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{labels}}} {self.ttft_count}\n'
            f"vllm:time_to_first_token_seconds_count{{{labels}}} {self.ttft_count}\n"
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} {self.ttft_seconds_sum}\n"
        )

    def _serve(self, port: int) -> None:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        loop.run_until_complete(self._runner.setup())
        loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", port).start())
        self.loop = loop
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        loop.run_forever()

    def __enter__(self) -> "_FloodingEngine":
        threading.Thread(target=self._serve, args=(free_port(),), daemon=True).start()
        assert self._ready.wait(5), "the flooding engine did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _run(name: str) -> BenchmarkRun:
    gpu_type = GpuTypeFactory(name="EMU-FLOOD")
    model = ServedModelFactory(name=name, engine_model_id="flood", reference_gpu_type=gpu_type)
    suite = services.suite_create(name=f"flood-{name}", grid=GRID, **SUITE)
    with _FloodingEngine() as engine:
        run = services.run_queue(
            suite=suite, endpoint_url=engine.url, served_model=model, gpu_type=gpu_type
        )
        services.run_execute(run_id=run.pk)
    run.refresh_from_db()
    return run


def test_a_run_whose_client_adds_over_10_percent_to_its_ttft_is_unreliable_and_not_fitted():
    run = _run("flooded")

    # The measurement itself went fine: every shape has a sustainable point ...
    assert run.status == BenchmarkRun.Status.SUCCEEDED, run.error + run.log
    assert run.samples.filter(sustainable=True).count() == len(GRID)
    # ... but the client's own lag is well over a tenth of the TTFT it measured,
    assert run.reliable is False
    assert run.client_overhead_share > 0.10
    assert run.client_overhead_ms > 0
    # so the run says why, and no cost model was recorded from it.
    assert run.fit_error.startswith("not fitted: the client added")
    assert "over the 10 % limit: the run measured its own client" in run.fit_error
    assert "not fitted: the client added" in run.log
    assert not CostModel.objects.exists()


def test_the_same_run_under_a_limit_it_stays_within_is_fitted(settings):
    # The control: what kept the cost model out above was the judgement, not the samples. No
    # limit at all: the client's lag may exceed the whole TTFT it measured (a share without
    # bound), since the runner reads the first token in the socket's callback.
    settings.BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT = float("inf")

    run = _run("flooded-allowed")

    assert run.status == BenchmarkRun.Status.SUCCEEDED, run.error + run.log
    assert run.reliable is True
    assert run.client_overhead_share > 0.10
    assert run.fit_error == ""
    assert CostModel.objects.filter(source_link__run=run).count() == 1
