"""Prefix-cache hits in the deployment load: read from vLLM's hit counter through a real
Prometheus scraping an emulator that caches, and priced with the cost model's cached-input
weight (capacity/telemetry/prometheus.py)."""

import asyncio
import threading
import time

import httpx
import pytest

from capacity.pricing.cost_models import cost_model_record
from capacity.pricing.features import Shape, mu_coefficients, mu_for
from capacity.telemetry.prometheus import mu_per_minute_of, read_deployment_load
from tests.support.factories import DeploymentFactory, ServedModelFactory
from tests.support.processes import emulator_process
from tests.support.prometheus_server import prometheus_server, wait_for_samples

MODEL = "cached-model"
EMULATOR_CONFIG = {
    "seed": 0,
    "models": [
        {
            "name": MODEL,
            "max_num_seqs": 64,
            "kv_cache_tokens": 8192,
            "context_length": 4096,
            "prefill_seconds_per_token": 1e-5,
            "decode_step_base_seconds": 0.01,
            "decode_seconds_per_sequence": 1e-5,
            "vocab_size": 32000,
            "enable_prefix_caching": True,
        }
    ],
}
WINDOW_SECONDS = 5
REQUESTS_PER_S = 20.0
# 64 shared tokens (four blocks) then 16 of the request's own: 64 of 80 hit.
SHARED_TOKENS, OWN_TOKENS, OUTPUT_TOKENS = 64, 16, 24
# Prefill dominates, so pricing the hits as uncached would be off by more than half.
WEIGHTS = {
    "input_tokens": 2e-3,
    "cached_input_tokens": 2e-4,
    "output_tokens": 1e-3,
    "input_x_output_per_1000": 0.01,
    "request": 5e-3,
}


class _CostModel:
    """The two fields mu_per_minute_of reads, without the database."""

    weights_replica_seconds = WEIGHTS
    replica_mu_per_minute = 100.0


def test_cache_hits_are_priced_with_the_cached_weight_and_the_rest_as_input():
    mu_per_minute = mu_per_minute_of(
        _CostModel(),
        requests_per_s=2.0,
        prompt_tokens_per_s=2 * 1000,
        generation_tokens_per_s=2 * 50,
        cached_prompt_tokens_per_s=2 * 800,
    )

    shape = Shape(input_tokens=200, cached_input_tokens=800, output_tokens=50)
    assert mu_per_minute == pytest.approx(2.0 * 60 * mu_for(WEIGHTS, shape))
    # Cheaper than the same prompts priced as uncached, as they were before.
    uncached = mu_per_minute_of(
        _CostModel(), requests_per_s=2.0, prompt_tokens_per_s=2000, generation_tokens_per_s=100
    )
    assert mu_per_minute < uncached
    assert uncached == pytest.approx(2.0 * 60 * mu_for(WEIGHTS, Shape(1000, 50)))


def test_hits_beyond_the_prompts_of_the_window_are_capped_at_them():
    capped = mu_per_minute_of(
        _CostModel(),
        requests_per_s=1.0,
        prompt_tokens_per_s=100,
        generation_tokens_per_s=10,
        cached_prompt_tokens_per_s=130,
    )
    all_cached = Shape(input_tokens=0, cached_input_tokens=100, output_tokens=10)
    assert capped == pytest.approx(60 * mu_for(WEIGHTS, all_cached))


def test_cached_tokens_in_a_window_without_finished_requests_are_priced_per_token():
    mu_per_minute = mu_per_minute_of(
        _CostModel(),
        requests_per_s=0.0,
        prompt_tokens_per_s=1000.0,
        generation_tokens_per_s=40.0,
        cached_prompt_tokens_per_s=600.0,
    )
    replica_seconds_per_s = 400 * 2e-3 + 600 * 2e-4 + 40 * 1e-3
    assert mu_per_minute == pytest.approx(replica_seconds_per_s * 100)


async def _drive_load(engine_url: str, seconds: float, errors: list[str]) -> None:
    """Open loop: every request shares the first SHARED_TOKENS tokens, then its own."""
    shared = list(range(1000, 1000 + SHARED_TOKENS))

    async def one(client: httpx.AsyncClient, index: int) -> None:
        own = [5000 + (index * OWN_TOKENS + k) % 20000 for k in range(OWN_TOKENS)]
        body = {
            "model": MODEL,
            "prompt": shared + own,
            "max_tokens": OUTPUT_TOKENS,
            "min_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{engine_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                errors.append(f"HTTP {response.status_code}: {await response.aread()!r}")
                return
            async for _ in response.aiter_lines():
                pass

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as client:
        start = asyncio.get_running_loop().time()
        tasks = []
        for index in range(int(seconds * REQUESTS_PER_S)):
            delay = start + index / REQUESTS_PER_S - asyncio.get_running_loop().time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, index)))
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, BaseException):
                errors.append(repr(outcome))


def test_the_load_of_an_engine_with_cache_hits_prices_them_as_cached(db, tmp_path):
    model = ServedModelFactory(engine_model_id=MODEL)
    cost_model_record(
        served_model=model,
        gpu_type=model.reference_gpu_type,
        gpus_per_replica=1,
        features=list(WEIGHTS),
        weights_replica_seconds=WEIGHTS,
        mu_per_unit=mu_coefficients(WEIGHTS),
        sample_count=12,
        distinct_shapes=12,
        cv_mape=0.02,
        cv_worst_error=0.05,
        candidates=[],
        residuals=[],
    )
    deployment = DeploymentFactory(served_model=model, gpu_pool__gpu_type=model.reference_gpu_type)

    with emulator_process(EMULATOR_CONFIG, tmp_path) as engine_url:
        target = engine_url.removeprefix("http://")
        with prometheus_server([target], tmp_path / "prometheus") as prometheus_url:
            wait_for_samples(prometheus_url, "vllm:prefix_cache_hits_total", count=2)
            errors: list[str] = []
            load = threading.Thread(
                target=asyncio.run, args=(_drive_load(engine_url, WINDOW_SECONDS + 3.0, errors),)
            )
            load.start()
            try:
                time.sleep(WINDOW_SECONDS + 1.5)
                measured = read_deployment_load(
                    deployment, window_seconds=WINDOW_SECONDS, url=prometheus_url
                )
            finally:
                load.join()
    assert errors == []

    assert measured.known, measured.reason
    prompt_tokens = SHARED_TOKENS + OWN_TOKENS
    assert measured.cached_prompt_tokens_per_s / measured.prompt_tokens_per_s == pytest.approx(
        SHARED_TOKENS / prompt_tokens, rel=0.05
    )
    mean_request = Shape(
        input_tokens=OWN_TOKENS, cached_input_tokens=SHARED_TOKENS, output_tokens=OUTPUT_TOKENS
    )
    assert measured.mu_per_minute / (measured.requests_per_s * 60) == pytest.approx(
        mu_for(WEIGHTS, mean_request), rel=0.1
    )
