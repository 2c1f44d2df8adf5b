"""Deployment load from a real Prometheus scraping the engine emulator
(capacity/telemetry/prometheus.py)."""

import asyncio
import socket
import threading
import time

import httpx
import pytest

from capacity.models import Deployment, ServedModel
from capacity.pricing.features import Shape, mu_coefficients, mu_for
from capacity.repricing.services import cost_model_record
from capacity.telemetry.prometheus import (
    InvalidSelectorError,
    mu_per_minute_of,
    read_deployment_load,
    read_fleet_load,
    selector_for,
    validate_selector,
)
from tests.support.factories import DeploymentFactory, ServedModelFactory
from tests.support.processes import emulator_process, free_port
from tests.support.prometheus_server import prometheus_server, wait_for_samples

BUSY_MODEL = "busy-model"
IDLE_MODEL = "idle-model"
# Slow enough steps (10 ms) that a request streams for ~0.25 s, so several always run at once.
_ENGINE = {
    "max_num_seqs": 64,
    "kv_cache_tokens": 8192,
    "context_length": 4096,
    "prefill_seconds_per_token": 1e-5,
    "decode_step_base_seconds": 0.01,
    "decode_seconds_per_sequence": 1e-5,
    "decode_seconds_per_context_token": 1e-8,
    "vocab_size": 32000,
}
EMULATOR_CONFIG = {
    "seed": 0,
    "models": [{"name": BUSY_MODEL, **_ENGINE}, {"name": IDLE_MODEL, **_ENGINE}],
}

WINDOW_SECONDS = 5
REQUESTS_PER_S = 20.0
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 24
# Every request sends the same prompt, so the engine's prefix cache serves all its full blocks
# but the one holding the last token (always computed): 3 blocks of 16.
CACHED_TOKENS = 48
# Known weights, replica-seconds per unit of each feature, with nonlinear terms that matter.
WEIGHTS_REPLICA_SECONDS = {
    "input_tokens": 1e-4,
    "cached_input_tokens": 2e-5,
    "output_tokens": 2e-3,
    "input_x_output_per_1000": 0.05,
    "output_sq_per_1000": 0.02,
    "request": 0.01,
}


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    with emulator_process(EMULATOR_CONFIG, tmp_path_factory.mktemp("emulator")) as url:
        yield url


@pytest.fixture(scope="module")
def prometheus_url(engine_url, tmp_path_factory):
    target = engine_url.removeprefix("http://")
    with prometheus_server([target], tmp_path_factory.mktemp("prometheus")) as url:
        # Rates need two samples in their window. Prometheus 2.42 applies a new target list
        # every 5 s, so the first scrape comes ~5 s after start whatever the interval.
        wait_for_samples(url, "vllm:num_requests_running", count=2)
        yield url


def _priced_model(engine_model_id: str) -> ServedModel:
    model = ServedModelFactory(engine_model_id=engine_model_id)
    cost_model_record(
        served_model=model,
        gpu_type=model.reference_gpu_type,
        gpus_per_replica=1,
        features=list(WEIGHTS_REPLICA_SECONDS),
        weights_replica_seconds=WEIGHTS_REPLICA_SECONDS,
        mu_per_unit=mu_coefficients(WEIGHTS_REPLICA_SECONDS),
        sample_count=12,
        distinct_shapes=12,
        cv_mape=0.02,
        cv_worst_error=0.05,
        candidates=[],
        residuals=[],
    )
    return model


def _deployment(model: ServedModel, **fields) -> Deployment:
    return DeploymentFactory(
        served_model=model, gpu_pool__gpu_type=model.reference_gpu_type, **fields
    )


async def _drive_load(engine_url: str, seconds: float, errors: list[str]) -> None:
    """Open loop: a streamed completion of the known shape every 1/REQUESTS_PER_S seconds."""
    body = {
        "model": BUSY_MODEL,
        "prompt": list(range(1, PROMPT_TOKENS + 1)),
        "max_tokens": OUTPUT_TOKENS,
        "min_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{engine_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                errors.append(f"HTTP {response.status_code}: {await response.aread()!r}")
                return
            async for _ in response.aiter_lines():
                pass

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        start = asyncio.get_running_loop().time()
        tasks = []
        for index in range(int(seconds * REQUESTS_PER_S)):
            delay = start + index / REQUESTS_PER_S - asyncio.get_running_loop().time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client)))
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, BaseException):
                errors.append(repr(outcome))


# A real rate through Prometheus: beside the niced pass its load driver and scrapes were starved
# once (15 requests/s read of the 20 sent).
@pytest.mark.serial
def test_it_reads_the_load_of_deployments_from_the_engines_metrics(db, engine_url, prometheus_url):
    busy = _deployment(_priced_model(BUSY_MODEL))
    idle = _deployment(_priced_model(IDLE_MODEL))
    elsewhere = _deployment(busy.served_model, prometheus_selector='model_name="not-served"')

    errors: list[str] = []
    load_seconds = WINDOW_SECONDS + 3.0
    load = threading.Thread(
        target=asyncio.run, args=(_drive_load(engine_url, load_seconds, errors),)
    )
    load.start()
    try:
        # Read while the load runs, once a whole window of it has been scraped.
        time.sleep(WINDOW_SECONDS + 1.5)
        loads = read_fleet_load(
            [busy, idle, elsewhere], window_seconds=WINDOW_SECONDS, url=prometheus_url
        )
        single = read_deployment_load(busy, window_seconds=WINDOW_SECONDS, url=prometheus_url)
    finally:
        load.join()
    assert errors == []

    measured = loads[busy.pk]
    assert measured.known, measured.reason
    assert measured.reason == ""
    assert measured.window_seconds == WINDOW_SECONDS
    assert measured.requests_per_s == pytest.approx(REQUESTS_PER_S, rel=0.2)
    # Both token counters and the request counter move together, so the mean shape is tight.
    mean_prompt_tokens = measured.prompt_tokens_per_s / measured.requests_per_s
    mean_output_tokens = measured.generation_tokens_per_s / measured.requests_per_s
    assert mean_prompt_tokens == pytest.approx(PROMPT_TOKENS, rel=0.05)
    assert mean_output_tokens == pytest.approx(OUTPUT_TOKENS, rel=0.05)
    # The engine's prefix-cache hits are priced at the cached weight, the rest as uncached.
    assert measured.prefix_cache_hits_per_s / measured.requests_per_s == pytest.approx(
        CACHED_TOKENS, rel=0.05
    )
    mu_per_request = mu_for(
        WEIGHTS_REPLICA_SECONDS,
        Shape.from_api(
            input_tokens=PROMPT_TOKENS,
            cached_input_tokens=CACHED_TOKENS,
            output_tokens=OUTPUT_TOKENS,
        ),
    )
    assert measured.mu_per_minute == pytest.approx(REQUESTS_PER_S * 60 * mu_per_request, rel=0.2)
    assert measured.mu_per_minute / (measured.requests_per_s * 60) == pytest.approx(
        mu_per_request, rel=0.1
    )
    assert measured.running > 0
    assert measured.concurrency == measured.running + measured.waiting
    assert 0 < measured.kv_cache_usage <= 1
    assert single.known and single.mu_per_minute == pytest.approx(measured.mu_per_minute, rel=0.2)

    # Series present but no traffic: known, and zero.
    quiet = loads[idle.pk]
    assert quiet.known, quiet.reason
    assert quiet.requests_per_s == 0
    assert quiet.mu_per_minute == 0
    assert quiet.concurrency == 0
    assert quiet.kv_cache_usage == 0

    # No series at all: unknown, never zero.
    unmatched = loads[elsewhere.pk]
    assert not unmatched.known
    assert unmatched.mu_per_minute is None and unmatched.requests_per_s is None
    assert 'no series match {model_name="not-served"}' in unmatched.reason


def test_a_deployment_without_traffic_is_known_at_zero_mu(db, prometheus_url):
    idle = _deployment(_priced_model(IDLE_MODEL))

    load = read_deployment_load(idle, window_seconds=WINDOW_SECONDS, url=prometheus_url)

    assert load.known, load.reason
    assert (load.requests_per_s, load.mu_per_minute, load.concurrency) == (0, 0, 0)


def test_a_selector_that_matches_nothing_is_unknown_not_zero(db, prometheus_url):
    # Quotes and braces in the engine id are escaped into the default selector, not injected.
    odd = _deployment(_priced_model('org/not"served}{'))

    load = read_deployment_load(odd, window_seconds=WINDOW_SECONDS, url=prometheus_url)

    assert not load.known
    assert load.mu_per_minute is None and load.concurrency is None
    assert load.reason.startswith(r'no series match {model_name="org/not\"served}{"}')
    assert "vllm:request_success_total" in load.reason


def test_an_unreachable_prometheus_is_unknown_not_zero(db):
    deployment = _deployment(_priced_model(BUSY_MODEL))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    started = time.monotonic()
    load = read_deployment_load(deployment, window_seconds=WINDOW_SECONDS, url=url)

    assert time.monotonic() - started < 2  # no retries with backoff
    assert not load.known
    assert load.mu_per_minute is None and load.requests_per_s is None
    assert load.reason.startswith(f"Prometheus unreachable at {url}: [Errno")


def test_a_prometheus_that_does_not_answer_in_time_is_unknown(db):
    deployment = _deployment(_priced_model(BUSY_MODEL))
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"

        started = time.monotonic()
        load = read_deployment_load(deployment, url=url, timeout_seconds=1)

    assert time.monotonic() - started < 3
    assert not load.known and load.mu_per_minute is None
    assert load.reason == f"Prometheus at {url} did not answer within 1 s"


def test_a_query_prometheus_refuses_is_unknown_and_does_not_blind_the_fleet(db, prometheus_url):
    idle = _deployment(_priced_model(IDLE_MODEL))
    bad_regex = _deployment(idle.served_model, prometheus_selector='model_name=~"("')

    loads = read_fleet_load([idle, bad_regex], window_seconds=WINDOW_SECONDS, url=prometheus_url)

    assert not loads[bad_regex.pk].known and loads[bad_regex.pk].mu_per_minute is None
    assert loads[bad_regex.pk].reason.startswith("Prometheus refused the query (HTTP 400): ")
    assert "missing closing )" in loads[bad_regex.pk].reason
    assert loads[idle.pk].known, loads[idle.pk].reason


def test_without_a_cost_model_the_rates_are_read_but_mu_is_unknown(db, prometheus_url):
    unpriced = _deployment(ServedModelFactory(engine_model_id=IDLE_MODEL))

    load = read_deployment_load(unpriced, window_seconds=WINDOW_SECONDS, url=prometheus_url)

    assert not load.known and load.mu_per_minute is None
    assert load.reason.startswith("MU/min unknown: No cost model for")
    assert load.requests_per_s == 0 and load.concurrency == 0


def test_without_a_prometheus_url_the_load_is_unknown(db, settings):
    settings.PROMETHEUS_URL = ""
    deployment = _deployment(_priced_model(BUSY_MODEL))

    load = read_deployment_load(deployment)

    assert not load.known and load.mu_per_minute is None
    assert load.reason == "Prometheus is not configured (PROMETHEUS_URL is empty)"


@pytest.mark.parametrize(
    "selector",
    [
        'model_name="m"} or vector(1) or up{job="x"',
        '{model_name="m"}',
        "model_name=m",
        'model_name="m',
        '"m"',
        'model_name="m" job="vllm"',
        'model_name="m"; drop',
        'model_name="bad \\q escape"',
        " , ",
    ],
)
def test_a_malformed_selector_is_a_clear_error(selector):
    deployment = Deployment(prometheus_selector=selector)

    with pytest.raises(InvalidSelectorError, match="is not a list of PromQL label matchers"):
        read_deployment_load(deployment, url="http://127.0.0.1:9")


def test_a_selector_may_not_pick_the_metric_name():
    with pytest.raises(InvalidSelectorError, match="matches __name__"):
        validate_selector('__name__="vllm:num_requests_running"')


def test_a_malformed_selector_in_a_fleet_read_makes_only_that_deployment_unknown(db):
    good = _deployment(_priced_model(BUSY_MODEL))
    bad = _deployment(good.served_model, prometheus_selector="{oops}")

    loads = read_fleet_load([good, bad], url=f"http://127.0.0.1:{free_port()}")

    assert "is not a list of PromQL label matchers" in loads[bad.pk].reason
    assert loads[good.pk].reason.startswith("Prometheus unreachable")


@pytest.mark.parametrize(
    ("selector", "normalised"),
    [
        ('job="vllm", namespace="prod"', 'job="vllm", namespace="prod"'),
        ('  job = "vllm" ,namespace!="dev", ', 'job="vllm", namespace!="dev"'),
        ("model_name=~'llama.*', pod!~`x-[0-9]+`", "model_name=~'llama.*', pod!~`x-[0-9]+`"),
        ('model_name="a}b{c\\"d"', 'model_name="a}b{c\\"d"'),
    ],
)
def test_valid_selectors_are_used_as_written(selector, normalised):
    deployment = Deployment(prometheus_selector=selector)

    assert selector_for(deployment) == normalised


def test_the_default_selector_is_the_engine_model_id():
    model = ServedModel(engine_model_id='meta-llama/Llama-3.1-8B "x"\\')

    assert (
        selector_for(Deployment(served_model=model))
        == 'model_name="meta-llama/Llama-3.1-8B \\"x\\"\\\\"'
    )


class _CostModel:
    """The two fields mu_per_minute_of reads, without the database."""

    weights_replica_seconds = WEIGHTS_REPLICA_SECONDS
    replica_mu_per_minute = 100.0


def test_mu_per_minute_prices_the_requests_at_their_mean_shape():
    mu_per_minute = mu_per_minute_of(
        _CostModel(),
        requests_per_s=2.0,
        prompt_tokens_per_s=2 * 300,
        generation_tokens_per_s=2 * 50,
    )

    assert mu_per_minute == pytest.approx(
        2.0 * 60 * mu_for(WEIGHTS_REPLICA_SECONDS, Shape(300, 50))
    )


def test_mu_per_minute_at_a_fractional_mean_shape_is_the_cost_model_at_that_point():
    requests_per_s, mean_input, mean_output = 3.0, 100.25, 10.4
    weights = WEIGHTS_REPLICA_SECONDS
    replica_seconds = (
        weights["input_tokens"] * mean_input
        + weights["output_tokens"] * mean_output
        + weights["input_x_output_per_1000"] * mean_input * mean_output / 1000
        + weights["output_sq_per_1000"] * mean_output**2 / 1000
        + weights["request"]
    )

    mu_per_minute = mu_per_minute_of(
        _CostModel(),
        requests_per_s=requests_per_s,
        prompt_tokens_per_s=requests_per_s * mean_input,
        generation_tokens_per_s=requests_per_s * mean_output,
    )

    # Within the interpolation bound on output²: w · 0.25 / 1000 replica-seconds per request.
    bound = requests_per_s * weights["output_sq_per_1000"] * 0.25 / 1000 * 100
    assert mu_per_minute == pytest.approx(requests_per_s * replica_seconds * 100, abs=bound)


def test_prefix_cache_hits_are_priced_with_the_cached_weight():
    # 2 requests/s of 300 prompt tokens, 200 of them served from the engines' prefix caches.
    mu_per_minute = mu_per_minute_of(
        _CostModel(),
        requests_per_s=2.0,
        prompt_tokens_per_s=2 * 300,
        prefix_cache_hits_per_s=2 * 200,
        generation_tokens_per_s=2 * 50,
    )

    cached = Shape(input_tokens=100, cached_input_tokens=200, output_tokens=50)
    assert mu_per_minute == pytest.approx(2.0 * 60 * mu_for(WEIGHTS_REPLICA_SECONDS, cached))
    # Cheaper than the same prompts uncached, by the difference of the two weights.
    uncached = mu_per_minute_of(
        _CostModel(), requests_per_s=2.0, prompt_tokens_per_s=600, generation_tokens_per_s=100
    )
    saved_replica_seconds_per_s = 400 * (
        WEIGHTS_REPLICA_SECONDS["input_tokens"] - WEIGHTS_REPLICA_SECONDS["cached_input_tokens"]
    )
    assert uncached - mu_per_minute == pytest.approx(saved_replica_seconds_per_s * 100)


def test_tokens_in_a_window_without_finished_requests_are_still_load():
    mu_per_minute = mu_per_minute_of(
        _CostModel(), requests_per_s=0.0, prompt_tokens_per_s=0.0, generation_tokens_per_s=40.0
    )

    assert mu_per_minute == pytest.approx(40.0 * WEIGHTS_REPLICA_SECONDS["output_tokens"] * 100)
    assert (
        mu_per_minute_of(
            _CostModel(), requests_per_s=0.0, prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0
        )
        == 0
    )
