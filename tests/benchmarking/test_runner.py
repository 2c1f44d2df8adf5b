"""The load runner against real HTTP servers: sweeps, SLO stops, error thresholds, timeouts."""

import asyncio
import json
import threading

import httpx
import pytest
from aiohttp import web

from benchmarking import runner
from core import outbound
from dataplane.emulator.background import BackgroundEmulator
from dataplane.emulator.config import parse_config
from simulation.engine.profile import ground_truth_replica_seconds

# Measures real throughput and latency: runs alone, not beside another test worker.
pytestmark = pytest.mark.serial

# The runner's connections are vetted; every server here listens on loopback.
LOOPBACK = outbound.HostPolicy.parse("BENCHMARK_ALLOWED_HOSTS", outbound.DEFAULT_ALLOWED_HOSTS)

TINY = {
    "name": "tiny",
    "max_num_seqs": 8,
    "kv_cache_tokens": 100_000,
    "context_length": 4096,
    "prefill_seconds_per_token": 1e-5,
    "decode_step_base_seconds": 3e-3,
    "decode_seconds_per_sequence": 1e-4,
    "decode_seconds_per_context_token": 0.0,
}


def spec(**overrides) -> runner.SuiteSpec:
    values = {
        "grid": ((64, 32),),
        "slo_ttft_p95_ms": 10_000,
        "slo_tpot_p95_ms": 1_000,
        "duration_per_point_seconds": 1.0,
        "concurrency_start": 2,
        "max_concurrency": 32,
        "request_timeout_seconds": 10,
    }
    return runner.SuiteSpec(**(values | overrides))


@pytest.fixture
def emulator():
    config = parse_config({"seed": 3, "models": [TINY]})
    with BackgroundEmulator(config) as running:
        yield running


class _FlakyServer:
    """Streams a valid completion, except every `fail_every`-th request gets a 500 (or never
    answers, to exercise timeouts). With `idle_metrics` it also answers /metrics with vLLM's
    counters, which never move: what a URL in front of some other engine (a proxy, a stale
    address) shows."""

    def __init__(self, *, fail_every: int, hang: bool = False, idle_metrics: bool = False):
        self.fail_every = fail_every
        self.hang = hang
        self.idle_metrics = idle_metrics
        self.count = 0
        self.prompts: set[tuple[int, ...]] = set()
        self.url = ""
        self._ready = threading.Event()

    async def completions(self, request):
        body = await request.json()
        self.count += 1
        self.prompts.add(tuple(body["prompt"]))
        if self.count > 1 and self.count % self.fail_every == 0:
            if self.hang:
                await asyncio.sleep(2)
            return web.json_response({"error": {"message": "boom"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": " tok"}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def metrics(self, request):
        return web.Response(
            text="# TYPE vllm:request_success_total counter\n"
            'vllm:request_success_total{model_name="tiny"} 0.0\n'
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            'vllm:time_to_first_token_seconds_count{model_name="tiny"} 0.0\n'
            'vllm:time_to_first_token_seconds_sum{model_name="tiny"} 0.0\n'
        )

    def _serve(self):
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        if self.idle_metrics:
            app.router.add_get("/metrics", self.metrics)
        app_runner = web.AppRunner(app, shutdown_timeout=0.5)
        loop.run_until_complete(app_runner.setup())
        site = web.TCPSite(app_runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.loop = loop
        self.app_runner = app_runner
        self._ready.set()
        loop.run_forever()

    def __enter__(self):
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc):
        async def shut_down():
            await self.app_runner.cleanup()
            # Handlers still sleeping (the hanging ones) are cancelled, not abandoned.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut_down(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_sweep_raises_concurrency_until_throughput_stops_growing(emulator):
    shapes = asyncio.run(
        runner.run_grid(host_policy=LOOPBACK, base_url=emulator.url, model="tiny", spec=spec())
    )
    shape = shapes[0]
    concurrencies = [point.concurrency for point in shape.points]
    assert concurrencies[:3] == [2, 4, 8]
    # Beyond max_num_seqs = 8 requests only wait, so throughput stops growing near there.
    assert "stopped growing" in shape.stop_reason or "max concurrency" in shape.stop_reason
    assert shape.sustainable.concurrency >= 8
    assert shape.points[1].requests_per_s > shape.points[0].requests_per_s * 1.5
    expected = 1 / ground_truth_replica_seconds(emulator.config.models[0], 64, 32, batch_size=8)
    assert shape.sustainable.requests_per_s == pytest.approx(expected, rel=0.15)


def test_a_tight_slo_stops_the_sweep_and_reports_why(emulator):
    shapes = asyncio.run(
        runner.run_grid(
            host_policy=LOOPBACK,
            base_url=emulator.url,
            model="tiny",
            spec=spec(slo_tpot_p95_ms=3.5),
        )
    )
    shape = shapes[0]
    assert "SLO broken" in shape.stop_reason
    assert all(point.tpot_p95_ms <= 3.5 for point in shape.points if point.slo_met)


def test_errors_past_the_threshold_stop_the_run_with_a_clear_error():
    with _FlakyServer(fail_every=3) as server, pytest.raises(runner.RunnerError) as raised:
        asyncio.run(
            runner.run_grid(host_policy=LOOPBACK, base_url=server.url, model="m", spec=spec())
        )
    message = str(raised.value)
    assert "failed at 64/32" in message
    assert "over the 5% limit" in message
    assert "HTTP 500" in message


def test_timeouts_are_counted_as_errors():
    with (
        _FlakyServer(fail_every=4, hang=True) as server,
        pytest.raises(runner.RunnerError, match="ReadTimeout|Timeout"),
    ):
        asyncio.run(
            runner.run_grid(
                host_policy=LOOPBACK,
                base_url=server.url,
                model="m",
                spec=spec(request_timeout_seconds=0.5, max_concurrency=2),
            )
        )


def test_an_unknown_model_fails_before_any_load(emulator):
    with pytest.raises(runner.RunnerError, match="cannot serve 'ghost'.*HTTP 404"):
        asyncio.run(
            runner.run_grid(host_policy=LOOPBACK, base_url=emulator.url, model="ghost", spec=spec())
        )


def test_the_runner_sends_no_load_where_its_policy_refuses():
    only_the_lab = outbound.HostPolicy.parse("BENCHMARK_ALLOWED_HOSTS", ["10.0.0.0/8"])

    with (
        _FlakyServer(fail_every=1000) as server,
        pytest.raises(
            runner.RunnerError, match=r"127.0.0.1 is not in BENCHMARK_ALLOWED_HOSTS=10\.0\.0\.0/8"
        ),
    ):
        asyncio.run(
            runner.run_grid(host_policy=only_the_lab, base_url=server.url, model="m", spec=spec())
        )
    assert server.count == 0


def test_two_replicas_are_measured_and_their_prefix_cache_hits_read_from_both_engines():
    # Restored from ea572b4 (backed out with the features branch in c831cf1), on today's
    # GridShape: a run over two held replicas reads every engine's counters, so each must
    # count requests, and the hit share is the shape's whichever replica served a request.
    config = parse_config({"seed": 1, "models": [TINY]})
    shared = runner.GridShape(256, 8, prefix_share=0.5)
    with BackgroundEmulator(config) as first, BackgroundEmulator(config) as second:
        (shape,) = asyncio.run(
            runner.run_grid(
                host_policy=LOOPBACK,
                base_url=[first.url, second.url],
                model="tiny",
                spec=spec(grid=(shared,), concurrency_start=4, max_concurrency=4),
            )
        )
        hits = [_counter(engine.url, "vllm:prefix_cache_hits_total") for engine in (first, second)]
    point = shape.sustainable
    assert point.engines_measured == 2 and point.engines_silent == ()
    assert all(hit > 0 for hit in hits), hits  # both engines' caches served the prefix
    # 128 shared tokens, eight full blocks: hit by every request but each engine's first.
    assert point.cache_hit_share == pytest.approx(0.5, rel=0.03)
    assert point.cached_input_tokens == pytest.approx(128, rel=0.03)


def test_a_url_whose_engine_counts_none_of_its_requests_stops_the_run_naming_it(emulator):
    # Two URLs, one of them served by no engine that counts (its /metrics never moves): the
    # throughput could not be divided per replica, so the runner stops at the first point.
    with (
        _FlakyServer(fail_every=10**9, idle_metrics=True) as stranger,
        pytest.raises(runner.RunnerError) as raised,
    ):
        asyncio.run(
            runner.run_grid(
                host_policy=LOOPBACK,
                base_url=[emulator.url, stranger.url],
                model="tiny",
                spec=spec(),
            )
        )
    message = str(raised.value)
    assert message.startswith(
        "only 1 of the 2 benchmarked replicas' engines counted requests at 64/32, concurrency 2"
    )
    assert f"no engine served the requests sent to {stranger.url}:" in message
    assert emulator.url not in message
    assert "would not be per replica" in message
    assert stranger.count > 1  # it was sent its lanes' share of the load


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_a_point_of_hundreds_of_streams_is_spread_over_client_processes_counting_each_once():
    # 128 streams over 2 processes (64 each, the least a process is given): every request the
    # server answered is counted once, and every prompt differs (no prefix cache could help).
    async def measure(url):
        session = runner.make_session(128, timeout_seconds=10, host_policy=LOOPBACK)
        endpoint = runner.Endpoint(url, "m", session=session, processes=2, host_policy=LOOPBACK)
        try:
            await endpoint.start_processes()
            assert [len(lanes) for lanes in endpoint.lane_shares(128)] == [64, 64]
            return await runner.measure_point(
                endpoint, input_len=16, output_len=4, concurrency=128, spec=spec()
            )
        finally:
            await endpoint.close()

    with _FlakyServer(fail_every=10**9) as server:
        point = asyncio.run(measure(server.url))

    assert point.error_count == 0 and point.request_count > 128
    assert server.count == point.request_count
    assert len(server.prompts) == server.count
    assert point.client_lag_p99_ms is not None  # both processes' event loops were watched


def test_few_streams_stay_in_the_callers_event_loop():
    session = None
    endpoint = runner.Endpoint("http://127.0.0.1:1", "m", session=session, processes=8,
                               host_policy=LOOPBACK)  # fmt: skip
    assert endpoint.lane_shares(32) == [tuple(range(32))]
    assert [len(lanes) for lanes in endpoint.lane_shares(512)] == [64] * 8


def test_percentiles_are_nearest_rank():
    assert runner.percentile([], 0.95) is None
    assert runner.percentile([5.0], 0.95) == 5.0
    assert runner.percentile(list(range(1, 101)), 0.95) == 95
