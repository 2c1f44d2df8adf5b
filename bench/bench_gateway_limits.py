"""The gateway as a trust boundary, at what cost (issue 34): its connection limits and its
callers' scope check beside the same gateway without the limits, round by round.

Two gateways (`python -m dataplane.gateway`, GATEWAY_WORKERS processes each) run side by side
on one engine emulator and one Redis, from the same build and contract (signed, as the control
plane signs it; every publication read is verified):

- on: the shipped defaults, every connection limit armed (dataplane/gateway/http.py `Limits`:
  header and body timers, per-worker and per-client connection caps, the bound on bodies in
  flight);
- off: the same gateway with every limit at 0 (off).

Both check each caller's scope (a customer key's `admission`, and for a service key the named
customer's entitlements; dataplane/gateway/auth.py): that check has no switch, so it is
measured on its own, in this process: `authenticate` (the whole of it: the key's hash, its
state and the scope) per request, beside the gateway's CPU per request in the closed loop.

- limits_requests_per_s: the closed loop (bench_gateway's, CONCURRENCY streams), on beside off.
  Target: at most 5 % fewer (>= 0.95x).
- limits_one_stream_p50_ms: one streamed request at a time, on beside off (the p50 end to end;
  what each adds to the emulator's own is printed). Target: at most 5 % more (<= 1.05x).
- scope_check_us: authenticate() per request beside the gateway's CPU per request. Target: at
  most 5 % of it (<= 0.05x).
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

import redis

from bench.bench_gateway import (
    CONFIG,
    CUSTOMER,
    Sample,
    UsageRecorder,
    _drive,
    _free_port,
    _measured,
    _one_stream,
    _publish_contract,
    _start_gateway,
    _stop,
)
from bench.bench_runner import _start_emulator
from bench.figures import Figure

ROUNDS = 5
LIMITS_OFF = {
    "GATEWAY_HEADER_TIMEOUT_SECONDS": "0",
    "GATEWAY_BODY_GRACE_SECONDS": "0",
    "GATEWAY_BODY_MIN_BYTES_PER_SECOND": "0",
    "GATEWAY_MAX_CONNECTIONS": "0",
    "GATEWAY_MAX_CONNECTIONS_PER_CLIENT": "0",
    "GATEWAY_MAX_BODY_BYTES_IN_FLIGHT": "0",
}
AUTH_CALLS = 20_000
# As bench_fail_safe's closed loops: short windows, more rounds alternating.
WARMUP_SECONDS = 0.5
WINDOW_SECONDS = 1.5


def _scope_check_us(key: str) -> float:
    """Microseconds of one `authenticate` (as a request pays it) of the bench's customer key."""
    from dataplane.gateway.auth import authenticate
    from dataplane.gateway.contract import build_contract

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    contract = build_contract(
        meta=client.hgetall("gw:v1:meta"),
        keys=client.hgetall("gw:v1:keys"),
        models=client.hgetall("gw:v1:models"),
        entitlements=client.hgetall("gw:v1:entitlements"),
    )
    header = f"Bearer {key}"
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(AUTH_CALLS):
            caller = authenticate(contract, header, None)
        best = min(best, (time.perf_counter() - started) / AUTH_CALLS * 1e6)
    assert caller.customer == CUSTOMER
    return best


def run() -> list[Figure]:
    with (
        tempfile.TemporaryDirectory(prefix="bench-gateway-limits-") as tmp,
        UsageRecorder() as usage,
    ):
        folder = Path(tmp)
        config_path = folder / "emulator.json"
        config_path.write_text(json.dumps(CONFIG))
        port = _free_port()
        processes: list[subprocess.Popen] = []
        try:
            processes.append(_start_emulator(config_path, port))
            emulator_url = f"http://127.0.0.1:{port}"
            key = _publish_contract(redis.Redis.from_url(os.environ["REDIS_URL"]), emulator_url)
            on, on_url, _ = _start_gateway(folder, usage.url)
            processes.append(on)
            (folder / "off").mkdir()
            off, off_url, _ = _start_gateway(folder / "off", usage.url, **LIMITS_OFF)
            processes.append(off)
            headers = {"Authorization": f"Bearer {key}"}
            setups = {"on": (on_url, on.pid), "off": (off_url, off.pid)}
            closed = {name: Sample() for name in setups}
            for _ in range(ROUNDS):
                for name, (url, pid) in setups.items():
                    sample = closed[name]
                    _measured(
                        sample,
                        {"gateway": pid},
                        _drive(
                            f"{url}/v1/chat/completions",
                            headers,
                            sample,
                            warmup_seconds=WARMUP_SECONDS,
                            window_seconds=WINDOW_SECONDS,
                        ),
                    )
            one = asyncio.run(
                _one_stream(
                    {
                        "direct": (f"{emulator_url}/v1/chat/completions", {}),
                        "on": (f"{on_url}/v1/chat/completions", headers),
                        "off": (f"{off_url}/v1/chat/completions", headers),
                    }
                )
            )
        finally:
            for process in reversed(processes):
                _stop(process)
    for name, sample in [*closed.items(), *one.items()]:
        if sample.errors:
            raise AssertionError(f"{name}: requests failed: {sample.errors.most_common(3)}")
    scope_us = _scope_check_us(key)
    rates = {name: [round(r) for r in sample.rates] for name, sample in closed.items()}
    direct_p50 = one["direct"].p(0.5)
    print(
        f"   closed loop requests/s {rates}; one stream p50 ms: direct {direct_p50:.2f}, "
        f"on {one['on'].p(0.5):.2f} (+{one['on'].p(0.5) - direct_p50:.2f}), "
        f"off {one['off'].p(0.5):.2f} (+{one['off'].p(0.5) - direct_p50:.2f}); "
        f"gateway CPU per request: on {closed['on'].cpu_us('gateway'):.0f} us, "
        f"off {closed['off'].cpu_us('gateway'):.0f} us; authenticate {scope_us:.2f} us",
        flush=True,
    )
    return [
        Figure(
            "limits_requests_per_s",
            statistics.median(closed["on"].rates),
            "requests/s",
            statistics.median(closed["off"].rates),
            "the same gateway, its connection limits off",
            target_ratio=0.95,
        ),
        Figure(
            "limits_one_stream_p50_ms",
            one["on"].p(0.5),
            "ms",
            one["off"].p(0.5),
            "the same gateway, its connection limits off",
            target_ratio=1.05,
            higher_is_better=False,
        ),
        Figure(
            "scope_check_us",
            scope_us,
            "us/request",
            closed["on"].cpu_us("gateway"),
            "the gateway's CPU per request (closed loop)",
            target_ratio=0.05,
            higher_is_better=False,
        ),
    ]
