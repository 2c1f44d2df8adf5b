"""Fail safe, at what cost (issue 33): the fail-safe paths beside the paths they guard, each
measured in the same run, round by round.

- stale_limits_decisions_per_s: `capacity.admission.gate.admit` in a loop (one process, one
  connection, as bench_admission's in-process figure) while the tick's heartbeat is stale, so
  that every decision ages the best-effort allowance in the script (the decaying path), beside
  the same loop with a fresh heartbeat (the allowance whole). Target: at most 5 % slower
  (>= 0.95x).
- fallback_requests_per_s: the gateway (GATEWAY_WORKERS processes) at CONCURRENCY concurrent
  streamed completions while its Redis is stopped: every decision made by a worker's own
  bucket, with the fallback's bookkeeping (the decision carried on each usage event), beside
  the same gateway build with its Redis answering (one EVALSHA a request). Two gateways run
  side by side on one emulator, one of them on a Redis of its own that is stopped once the
  gateway has read its contract. Target: at most 5 % slower (>= 0.95x).
- fallback_admitted_mu: a reserved customer asking three times its reservation through that
  gateway while Redis is down, for FALLBACK_WINDOW_SECONDS: the MU its workers admitted, beside
  what the reservation holds over the window (plus one burst, which each worker's bucket may
  spend at once). Before issue 33 the gateway admitted everything here (GATEWAY_ON_REDIS_DOWN
  = admit), three times the reservation; the bound is 1.0x plus the burst's share.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import redis

from bench.bench_gateway import (
    CONFIG,
    CUSTOMER_ID,
    MODEL,
    RESERVATION_MU_PER_MINUTE,
    WEIGHTS,
    Sample,
    UsageRecorder,
    _drive,
    _free_port,
    _publish_contract,
    _start_gateway,
    _stop,
)
from bench.bench_runner import _start_emulator
from bench.figures import Figure
from capacity.pricing.features import mu_of, replica_seconds_of
from tests.support.publication import write_signed

ROUNDS = 3
# As bench_gateway's closed loop: enough streams that the gateway, not the engine, binds.
CONCURRENCY = 256
STALE_ROUNDS = 7
WARMUP_SECONDS = 0.5
WINDOW_SECONDS = 1.5
DECISIONS_PER_ROUND = 2000
# The bounded check: a reservation asked three times over while Redis is down.
BOUNDED_MU_PER_MINUTE = 30.0
FALLBACK_WINDOW_SECONDS = 6.0
BURST_SECONDS = 10.0


def _admission_fixture():
    """A model with a cost model, a customer with a floor and an allowance far above the load
    (names unique to this bench: benchmarks share the database)."""
    from accounts.services import customer_create
    from bench.bench_admission import WEIGHTS as ADMISSION_WEIGHTS
    from capacity.admission import gate as admission
    from capacity.admission.bucket import Floor
    from capacity.allocation.policy import Allowance
    from capacity.models import GpuType, ServedModel
    from capacity.pricing.features import mu_coefficients
    from capacity.repricing.services import cost_model_record

    gpu = GpuType.objects.create(name="bench-fail-safe-h100", memory_gb=80, hourly_cost_usd=4)
    model = ServedModel.objects.create(
        name="bench-fail-safe",
        parameters_billions=8,
        context_length_tokens=8192,
        reference_gpu_type=gpu,
    )
    cost_model_record(
        served_model=model, gpu_type=gpu, gpus_per_replica=1, features=list(ADMISSION_WEIGHTS),
        weights_replica_seconds=ADMISSION_WEIGHTS, mu_per_unit=mu_coefficients(ADMISSION_WEIGHTS),
        sample_count=10, distinct_shapes=10, cv_mape=0.01, cv_worst_error=0.02, candidates=[],
        residuals=[],
    )  # fmt: skip
    customer = customer_create(name="Bench fail safe", slug="bench-fail-safe")
    admission.publish_limits([Allowance(customer.pk, model.pk, 0.0, 1e9)])
    pair = (customer.pk, model.pk)
    # No floor of its own (best-effort only), but floors written: the store holds its state.
    admission.buckets().publish_floors({pair: Floor(0.0)}, pairs=[pair])
    return customer, model


def _stale_limits() -> list[Figure]:
    """Decisions per second of a best-effort customer, the tick's heartbeat stale (the
    allowance decaying in the script) and fresh, round by round."""
    from django.conf import settings

    from capacity.admission import gate as admission
    from capacity.admission.redis_layout import LIMITS_TICK_KEY

    customer, model = _admission_fixture()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)

    def heartbeat(age_seconds: float) -> None:
        seconds, micros = client.time()
        client.set(LIMITS_TICK_KEY, repr(seconds * 1000 + micros / 1000 - age_seconds * 1000))

    def decide():
        return admission.admit(
            customer_id=customer.pk, model=model.name, input_tokens=500, max_tokens=100
        )

    half_way = (
        settings.ADMISSION_TICK_STALE_SECONDS + settings.ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS
    ) / 2
    rates: dict[str, list[float]] = {"fresh": [], "stale": []}
    for _ in range(STALE_ROUNDS):
        for name, age in (("fresh", 0.0), ("stale", half_way)):
            heartbeat(age)
            for _ in range(200):
                decision = decide()
            if decision.admission_class != "best_effort" or decision.degraded:
                raise AssertionError(f"the benchmark's decisions must be best-effort: {decision}")
            started = time.perf_counter()
            for _ in range(DECISIONS_PER_ROUND):
                decide()
            rates[name].append(DECISIONS_PER_ROUND / (time.perf_counter() - started))
    print(f"   decisions/s fresh {rates['fresh']}, stale {rates['stale']}", flush=True)
    return [
        Figure(
            "stale_limits_decisions_per_s",
            statistics.median(rates["stale"]),
            "decisions/s",
            statistics.median(rates["fresh"]),
            "the same admit() with the tick fresh",
            target_ratio=0.95,
        )
    ]


def _private_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return process, url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _publish_reservation(client: redis.Redis, mu_per_minute: float) -> None:
    """gw:v1:reservations: what the gateway's workers admit by while Redis is down."""
    doc = {MODEL["name"]: {"mu_per_minute": mu_per_minute, "steps": []}}
    write_signed(client, {"gw:v1:reservations": {str(CUSTOMER_ID): json.dumps(doc)}})


def _closed_loop(url: str, key: str) -> Sample:
    sample = Sample()
    for _ in range(1):
        asyncio.run(
            _drive(
                f"{url}/v1/chat/completions",
                {"Authorization": f"Bearer {key}"},
                sample,
                warmup_seconds=WARMUP_SECONDS,
                window_seconds=WINDOW_SECONDS,
                lanes=CONCURRENCY,
            )
        )
    return sample


async def _ask_over(url: str, key: str, rate_per_s: float, seconds: float) -> tuple[int, int]:
    """(sent, admitted): streamed requests at a steady rate for `seconds`."""
    body = json.dumps(
        {"model": MODEL["name"], "messages": [{"role": "user", "content": "x" * 80}],
         "max_tokens": 16, "stream": True}
    ).encode()  # fmt: skip
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    counts = {"sent": 0, "admitted": 0}

    async def one(session: aiohttp.ClientSession) -> None:
        counts["sent"] += 1
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            await r.read()
            counts["admitted"] += r.status == 200

    tasks = []
    async with aiohttp.ClientSession(trust_env=False) as session:
        start = time.perf_counter()
        n = 0
        while (due := start + n / rate_per_s) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session)))
            n += 1
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts["sent"], counts["admitted"]


def _fallback() -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="bench-fail-safe-") as tmp, UsageRecorder() as usage:
        folder = Path(tmp)
        config_path = folder / "emulator.json"
        config_path.write_text(json.dumps(CONFIG))
        port = _free_port()
        processes: list[subprocess.Popen] = []
        try:
            processes.append(_start_emulator(config_path, port))
            emulator_url = f"http://127.0.0.1:{port}"
            live = redis.Redis.from_url(os.environ["REDIS_URL"])
            live_key = _publish_contract(live, emulator_url)
            gateway, gateway_url, _ = _start_gateway(folder, usage.url)
            processes.append(gateway)
            own_redis, own_url = _private_redis(folder)
            processes.append(own_redis)
            own = redis.Redis.from_url(own_url)
            down_key = _publish_contract(own, emulator_url)
            _publish_reservation(own, RESERVATION_MU_PER_MINUTE)
            saved = os.environ["REDIS_URL"]
            os.environ["REDIS_URL"] = own_url  # the second gateway's Redis
            (folder / "down").mkdir()
            try:
                down, down_url, _ = _start_gateway(folder / "down", usage.url)
            finally:
                os.environ["REDIS_URL"] = saved
            processes.append(down)
            _stop(own_redis)  # from here on, every decision of `down` is its fallback's
            up_rates, down_rates = [], []
            for _ in range(ROUNDS):
                up_rates.append(_closed_loop(gateway_url, live_key).rps)
                down_rates.append(_closed_loop(down_url, down_key).rps)
            print(f"   fallback closed loops: up {up_rates}, down {down_rates}", flush=True)
            _stop(down)
            # The bounded check: a gateway whose contract says 30 MU/min, its Redis down.
            own_redis, own_url = _private_redis(folder)
            processes.append(own_redis)
            own = redis.Redis.from_url(own_url)
            bounded_key = _publish_contract(own, emulator_url)
            _publish_reservation(own, BOUNDED_MU_PER_MINUTE)
            os.environ["REDIS_URL"] = own_url
            (folder / "bounded").mkdir()
            try:
                bounded, bounded_url, _ = _start_gateway(folder / "bounded", usage.url)
            finally:
                os.environ["REDIS_URL"] = saved
            processes.append(bounded)
            _stop(own_redis)
            cost_mu = mu_of(replica_seconds_of(WEIGHTS, input_tokens=20, output_tokens=16), 100)
            rate = 3 * BOUNDED_MU_PER_MINUTE / 60 / cost_mu  # three times the reservation
            sent, admitted = asyncio.run(
                _ask_over(bounded_url, bounded_key, rate, FALLBACK_WINDOW_SECONDS)
            )
        finally:
            for process in reversed(processes):
                _stop(process)
    reserved_mu = BOUNDED_MU_PER_MINUTE * FALLBACK_WINDOW_SECONDS / 60
    burst_mu = BOUNDED_MU_PER_MINUTE * BURST_SECONDS / 60
    print(
        f"   Redis down {FALLBACK_WINDOW_SECONDS:g} s: {admitted} of {sent} requests admitted, "
        f"{admitted * cost_mu:.2f} MU against the reservation's {reserved_mu:.2f} MU "
        f"(+{burst_mu:.2f} MU of burst; asked {sent * cost_mu:.2f} MU)",
        flush=True,
    )
    return [
        Figure(
            "fallback_requests_per_s",
            statistics.median(down_rates),
            "requests/s",
            statistics.median(up_rates),
            "the same gateway with Redis answering",
            target_ratio=0.95,
        ),
        Figure(
            "fallback_admitted_mu",
            admitted * cost_mu,
            "MU",
            reserved_mu + burst_mu,
            f"the reservation over {FALLBACK_WINDOW_SECONDS:g} s plus its burst (asked 3x)",
            target_ratio=1.0 + cost_mu / (reserved_mu + burst_mu),
            higher_is_better=False,
        ),
    ]


def run() -> list[Figure]:
    return _stale_limits() + _fallback()
