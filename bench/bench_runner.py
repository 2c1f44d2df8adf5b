"""The load runner's own ceiling at 512 concurrent streams (issues 21 and 24).

The emulator is configured so that it could serve far more than any client can ask for
(all 512 sequences fit one batch; a decode step costs 10 ms whatever the batch), and the same
closed loop, 512 streamed requests at a time over real sockets to the emulator in its own
process, is driven twice:

- through the runner (what `run_benchmark` does);
- baseline: `wrk`, a load generator in C (Debian's package), with the same 512 connections
  and the same request body, reading each streamed response to its end. What wrk reaches is
  the emulator's ceiling over HTTP on this machine: the runner's figure is the share of it the
  runner reaches, so the runner's own cost shows, not the emulator's HTTP server's.

The client-side overhead is the runner's p99 end-to-end latency minus wrk's, beside the
engine's own p99 driven in this process with no HTTP and no client (target: ≤ 10 % of it).
The engine in-process throughput is printed too, for reference: no HTTP client reaches it.
Each figure is the median of 3 runs.
"""

import asyncio
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from django.conf import settings

from bench.figures import Figure
from benchmarking import runner
from core import outbound
from dataplane.emulator.config import parse_config
from dataplane.emulator.engine import Listener
from dataplane.emulator.fleet import ModelFleet
from tests.support.processes import emulator_command

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 512
RUNS = 3
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


async def _runner_closed_loop(base_url: str, processes: int) -> tuple[float, float, int, float]:
    """(requests/s, p99 e2e seconds, errors, p99 event-loop lag ms) through the runner over
    HTTP."""
    spec = runner.SuiteSpec(
        grid=((INPUT_LEN, OUTPUT_LEN),),
        slo_ttft_p95_ms=1e9,
        slo_tpot_p95_ms=1e9,
        duration_per_point_seconds=WINDOW_SECONDS,
        max_concurrency=CONCURRENCY,
        request_timeout_seconds=60,
    )
    session = runner.make_session(CONCURRENCY, timeout_seconds=60, host_policy=LOOPBACK)
    try:
        endpoint = runner.Endpoint(
            base_url, MODEL["name"], session=session, processes=processes, host_policy=LOOPBACK
        )
        await endpoint.check()
        await endpoint.start_processes()
        point = await runner.measure_point(
            endpoint,
            input_len=INPUT_LEN,
            output_len=OUTPUT_LEN,
            concurrency=CONCURRENCY,
            spec=spec,
        )
    finally:
        await endpoint.close()
    return (
        point.requests_per_s,
        (point.e2e_p99_ms or 0) / 1000,
        point.error_count,
        point.client_lag_p99_ms or 0.0,
    )


def _wrk_body() -> str:
    """The runner's own request body for the shape (its token ids, salt 1)."""
    return json.dumps(
        {
            "model": MODEL["name"],
            "prompt": runner.prompt_token_ids(INPUT_LEN, 1),
            "max_tokens": OUTPUT_LEN,
            "min_tokens": OUTPUT_LEN,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


_WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _wrk_closed_loop(base_url: str, folder: Path) -> tuple[float, float]:
    """(requests/s, p99 seconds) of wrk, 512 connections, over the runner's window."""
    script = folder / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(_wrk_body())}\n"
    )
    # A warm-up pass opens the connections, as the runner's warm-up does.
    for seconds in (WARMUP_SECONDS, WINDOW_SECONDS):
        done = subprocess.run(
            ["wrk", "-t2", f"-c{CONCURRENCY}", f"-d{max(1, round(seconds))}s", "--latency",
             "-s", str(script), base_url + "/v1/completions"],
            capture_output=True, text=True, timeout=seconds + 60, check=True,
        )  # fmt: skip
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", done.stdout).group(1))
    value, unit = re.search(r"99%\s+([\d.]+)(us|ms|s|m)\b", done.stdout).groups()
    if "Non-2xx" in done.stdout or "Socket errors" in done.stdout:
        raise AssertionError(f"wrk saw errors against the emulator:\n{done.stdout}")
    return rps, float(value) * _WRK_UNITS[unit]


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

    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is missing: make bench installs it (apt-get install wrk)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = settings.BENCHMARK_CLIENT_PROCESSES
    runs: list[tuple[float, float, float, float, float, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        config_path = Path(folder) / "ceiling.json"
        config_path.write_text(json.dumps(CONFIG))
        process = _start_emulator(config_path, port)
        try:
            base_url = f"http://127.0.0.1:{port}"
            # Interleaved, so that a slower minute of the machine weighs on both alike.
            for _ in range(RUNS):
                runner_rps, runner_p99_seconds, errors, lag_p99_ms = asyncio.run(
                    _runner_closed_loop(base_url, processes)
                )
                one_rps, _, one_errors, _ = asyncio.run(_runner_closed_loop(base_url, 1))
                if errors or one_errors:
                    raise AssertionError(
                        f"{errors + one_errors} requests failed during the ceiling run"
                    )
                wrk_rps, wrk_p99_seconds = _wrk_closed_loop(base_url, Path(folder))
                runs.append(
                    (runner_rps, runner_p99_seconds, one_rps, wrk_rps, wrk_p99_seconds, lag_p99_ms)
                )
        finally:
            process.terminate()
            process.wait(timeout=10)
    engine_rps, engine_p99_seconds = asyncio.run(_engine_closed_loop())
    runner_rps, runner_p99_seconds, one_rps, wrk_rps, wrk_p99_seconds, lag_p99_ms = (
        statistics.median(column) for column in zip(*runs, strict=True)
    )
    overhead_ms = max(0.0, (runner_p99_seconds - wrk_p99_seconds) * 1000)
    return [
        Figure(
            name=f"runner_requests_per_s_at_{CONCURRENCY}_streams",
            value=runner_rps,
            unit="requests/s",
            baseline=wrk_rps,
            baseline_name=f"wrk (C) against the same emulator: its HTTP ceiling; "
            f"runner in {processes} processes",
            target_ratio=0.8,
        ),
        Figure(
            name=f"runner_one_process_requests_per_s_at_{CONCURRENCY}_streams",
            value=one_rps,
            unit="requests/s",
            baseline=wrk_rps,
            baseline_name="wrk against the same emulator (reference)",
        ),
        Figure(
            name=f"runner_requests_per_s_at_{CONCURRENCY}_streams_vs_engine",
            value=runner_rps,
            unit="requests/s",
            baseline=engine_rps,
            baseline_name="engine in-process, no HTTP, no client (reference)",
        ),
        Figure(
            name="runner_p99_client_overhead",
            value=overhead_ms,
            unit="ms",
            baseline=engine_p99_seconds * 1000,
            baseline_name="engine p99 e2e, no client; overhead = runner p99 - wrk p99",
            target_ratio=0.10,
            higher_is_better=False,
        ),
        Figure(
            # The overhead above compares two clients' latencies, which the throughput each
            # reaches also moves (a closed loop: latency ~ streams / throughput); the runner's
            # own event-loop lag is what every response waits behind before it is timed.
            name="runner_event_loop_lag_p99",
            value=lag_p99_ms,
            unit="ms",
            baseline=engine_p99_seconds * 1000,
            baseline_name="engine p99 e2e, no client (reference: the runner's own loop lag)",
            higher_is_better=False,
        ),
    ]
