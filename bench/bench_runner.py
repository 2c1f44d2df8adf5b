"""The load runner's own ceiling at 512 concurrent streams.

The emulator is configured so that it could serve far more than any client can ask for
(all 512 sequences fit one batch; a decode step costs 10 ms whatever the batch), and the same
closed loop is measured twice:

- through the runner: 512 streamed HTTP requests at a time, over real sockets, against the
  emulator in its own process (what `run_benchmark` does);
- baseline: the emulator's engine driven in this process with no HTTP and no client: the
  same 512-deep closed loop submitting sequences straight to the fleet.

Throughput is computed the same way for both (each request counted by the share of its
lifetime inside the measuring window). The client-side overhead is the runner's p99
end-to-end latency minus the engine's own p99 for the same shapes.
"""

import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.figures import Figure
from benchmarking import runner
from controlplane import outbound
from dataplane.emulator.config import parse_config
from dataplane.emulator.engine import Listener
from dataplane.emulator.fleet import ModelFleet
from tests.support.processes import emulator_command

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 512
INPUT_LEN = 32
OUTPUT_LEN = 16
WINDOW_SECONDS = 6.0
WARMUP_SECONDS = 1.5
MODEL = {
    "name": "ceiling",
    "replicas": 1,
    "max_num_seqs": 1024,
    "kv_cache_tokens": 1_000_000,
    "context_length": 4096,
    "prefill_seconds_per_token": 0.0,
    "decode_step_base_seconds": 0.010,
    "decode_seconds_per_sequence": 0.0,
    "decode_seconds_per_context_token": 0.0,
}
CONFIG = {"seed": 1, "models": [MODEL]}
# The runner's connections are vetted as in production; the emulator listens on loopback.
LOOPBACK = outbound.HostPolicy.parse("BENCHMARK_ALLOWED_HOSTS", outbound.DEFAULT_ALLOWED_HOSTS)


def _p99(values: list[float]) -> float:
    return runner.percentile(values, 0.99) or 0.0


def _lifetime_rate(spans: list[tuple[float, float]], start: float, end: float) -> float:
    share = 0.0
    for began, finished in spans:
        overlap = min(finished, end) - max(began, start)
        share += max(0.0, overlap) / max(finished - began, 1e-9)
    return share / (end - start)


async def _engine_closed_loop() -> tuple[float, float]:
    """(requests/s, p99 e2e seconds) with the engine driven directly."""
    model = parse_config(CONFIG).models[0]
    fleet = ModelFleet(model, seed=1)
    fleet.start()
    prompt = list(range(100, 100 + INPUT_LEN))
    spans: list[tuple[float, float]] = []
    counter = iter(range(10**9))
    start = time.perf_counter()
    window_start = start + WARMUP_SECONDS
    window_end = window_start + WINDOW_SECONDS

    async def worker():
        while time.perf_counter() < window_end:
            listener = Listener(streaming=False)
            seq = fleet.new_sequence(
                request_id=f"b{next(counter)}",
                prompt_token_ids=prompt,
                max_tokens=OUTPUT_LEN,
                min_tokens=OUTPUT_LEN,
                ignore_eos=True,
                priority=0,
                request_seed=None,
                prompt_index=0,
                listener=listener,
            )
            began = time.perf_counter()
            fleet.submit(seq)
            while not seq.done:
                await listener.wait()
            spans.append((began, time.perf_counter()))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    await fleet.stop()
    settled = [(b, f) for b, f in spans if window_start <= f <= window_end]
    return _lifetime_rate(spans, window_start, window_end), _p99([f - b for b, f in settled])


async def _runner_closed_loop(base_url: str) -> tuple[float, float, int]:
    """(requests/s, p99 e2e seconds, errors) through the runner over HTTP."""
    spec = runner.SuiteSpec(
        grid=((INPUT_LEN, OUTPUT_LEN),),
        slo_ttft_p95_ms=1e9,
        slo_tpot_p95_ms=1e9,
        duration_per_point_seconds=WINDOW_SECONDS,
        max_concurrency=CONCURRENCY,
        request_timeout_seconds=60,
    )
    clients = runner.make_clients(CONCURRENCY, timeout_seconds=60, host_policy=LOOPBACK)
    try:
        endpoint = runner.Endpoint(base_url, MODEL["name"], clients=clients)
        await endpoint.check()
        point = await runner.measure_point(
            endpoint,
            input_len=INPUT_LEN,
            output_len=OUTPUT_LEN,
            concurrency=CONCURRENCY,
            spec=spec,
        )
    finally:
        for client in clients:
            await client.aclose()
    # measure_point reports p95; the p99 comes from the same e2e definition below.
    return point.requests_per_s, (point.e2e_p95_ms or 0) / 1000, point.error_count


async def _runner_p99(base_url: str) -> float:
    """p99 end-to-end latency of a second, shorter runner pass (the point API gives p95)."""
    latencies: list[float] = []
    clients = runner.make_clients(CONCURRENCY, timeout_seconds=60, host_policy=LOOPBACK)
    endpoint = runner.Endpoint(base_url, MODEL["name"], clients=clients)
    deadline = time.perf_counter() + WARMUP_SECONDS + WINDOW_SECONDS / 2
    window_start = time.perf_counter() + WARMUP_SECONDS

    async def worker(lane: int):
        while time.perf_counter() < deadline:
            result = await endpoint.complete(
                input_len=INPUT_LEN, output_len=OUTPUT_LEN, timeout_seconds=60, lane=lane
            )
            if result.ok and result.finished_s >= window_start:
                latencies.append(result.finished_s - result.started_s)

    try:
        await asyncio.gather(*(worker(lane) for lane in range(CONCURRENCY)))
    finally:
        for client in clients:
            await client.aclose()
    return _p99(latencies)


def _start_emulator(config_path: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        emulator_command(config_path, port),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the emulator did not start")


def run() -> list[Figure]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        config_path = Path(folder) / "ceiling.json"
        config_path.write_text(json.dumps(CONFIG))
        process = _start_emulator(config_path, port)
        try:
            base_url = f"http://127.0.0.1:{port}"
            runner_rps, _, errors = asyncio.run(_runner_closed_loop(base_url))
            runner_p99_seconds = asyncio.run(_runner_p99(base_url))
        finally:
            process.terminate()
            process.wait(timeout=10)
    if errors:
        raise AssertionError(f"{errors} requests failed during the ceiling run")
    engine_rps, engine_p99_seconds = asyncio.run(_engine_closed_loop())
    overhead_ms = max(0.0, (runner_p99_seconds - engine_p99_seconds) * 1000)
    return [
        Figure(
            name=f"runner_requests_per_s_at_{CONCURRENCY}_streams",
            value=runner_rps,
            unit="requests/s",
            baseline=engine_rps,
            baseline_name="engine in-process, no client",
        ),
        Figure(
            name="runner_p99_client_overhead",
            value=overhead_ms,
            unit="ms",
            baseline=engine_p99_seconds * 1000,
            baseline_name="engine p99 e2e, no client",
        ),
    ]
