"""Helpers for talking to an emulator over real HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from dataplane.emulator.config import parse_config


def model(name: str = "tiny", **overrides) -> dict:
    """A fast model: 2 ms decode steps, nothing else costs time unless a test says so."""
    spec = {
        "name": name,
        "replicas": 1,
        "cold_start_seconds": 0,
        "max_num_seqs": 64,
        "kv_cache_tokens": 65536,
        "context_length": 2048,
        "prefill_seconds_per_token": 0.0,
        "decode_step_base_seconds": 0.002,
        "decode_seconds_per_sequence": 0.0,
        "decode_seconds_per_context_token": 0.0,
        "mean_output_tokens": 16,
        "vocab_size": 32000,
    }
    spec.update(overrides)
    return spec


def config(*models: dict, seed: int = 0):
    return parse_config({"seed": seed, "models": list(models) or [model()]})


@dataclass
class StreamResult:
    status: int
    events: list[dict] = field(default_factory=list)
    done: bool = False
    started_seconds: float = 0.0
    # perf_counter() when each token-bearing event arrived
    token_seconds: list[float] = field(default_factory=list)

    @property
    def token_events(self) -> list[dict]:
        return [e for e in self.events if e.get("choices")]

    @property
    def ttft_seconds(self) -> float:
        return self.token_seconds[0] - self.started_seconds


def _parse_line(line: str, result: StreamResult, now: float) -> None:
    if not line.startswith("data: "):
        return
    payload = line[len("data: ") :]
    if payload == "[DONE]":
        result.done = True
        return
    event = json.loads(payload)
    result.events.append(event)
    choices = event.get("choices") or []
    if any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
        result.token_seconds.append(now)


def stream(client: httpx.Client, url: str, body: dict) -> StreamResult:
    started = time.perf_counter()
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        result = StreamResult(status=response.status_code, started_seconds=started)
        if response.status_code != 200:
            response.read()
            result.events.append(response.json())
            return result
        for line in response.iter_lines():
            _parse_line(line, result, time.perf_counter())
    return result


async def astream(client: httpx.AsyncClient, url: str, body: dict) -> StreamResult:
    started = time.perf_counter()
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        result = StreamResult(status=response.status_code, started_seconds=started)
        async for line in response.aiter_lines():
            _parse_line(line, result, time.perf_counter())
    return result


def scrape(client: httpx.Client, base_url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{labels}': value}, labels as rendered."""
    text = client.get(f"{base_url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """One sample, matching labels in any order."""
    for key, value in samples.items():
        sample_name, _, rest = key.partition("{")
        if sample_name != name:
            continue
        pairs = dict(
            part.split("=", 1) for part in rest.rstrip("}").split(",") if part and "=" in part
        )
        if all(pairs.get(k) == f'"{v}"' for k, v in labels.items()):
            return value
    raise KeyError(f"no sample {name}{labels}")


def wait_until(predicate, timeout_seconds: float = 5.0, interval_seconds: float = 0.005):
    deadline = time.perf_counter() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.perf_counter() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval_seconds)


def wait_for_samples(client: httpx.Client, base_url: str, predicate) -> dict[str, float]:
    """Scrape /metrics until `predicate(samples)` holds; returns those samples."""
    return wait_until(
        lambda: (samples := scrape(client, base_url)) and predicate(samples) and samples
    )


def start_streams(base_url: str, bodies: list[dict]) -> concurrent.futures.Future:
    """Send streamed completions concurrently from a loop of their own, without blocking.

    The future resolves to their `StreamResult`s, in order.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    async def main():
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            url = f"{base_url}/v1/completions"
            return await asyncio.gather(*(astream(client, url, body) for body in bodies))

    def run():
        try:
            future.set_result(asyncio.run(main()))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future
