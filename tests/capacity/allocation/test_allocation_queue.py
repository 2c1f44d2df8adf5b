"""The tick plans for requests queued in the engines, read from a real Prometheus scraping
the engine emulator: usage is metered when requests finish, so a fleet too small for its
demand shows only what it manages to finish."""

import time

import httpx
import pytest

from capacity.allocation.tick import allocation_tick
from capacity.models import AllocationDecision, Deployment
from tests.capacity.allocation.test_allocation_tick import use
from tests.dataplane.emulator.support import start_streams
from tests.support.processes import emulator_process
from tests.support.prometheus_server import prometheus_server, wait_for_samples

pytestmark = pytest.mark.django_db

ENGINE_MODEL = "queued-model"
# One sequence at a time, 50 ms a step: a request of 100 tokens holds the replica 5 s.
EMULATOR_CONFIG = {
    "seed": 0,
    "models": [
        {
            "name": ENGINE_MODEL,
            "max_num_seqs": 1,
            "decode_step_base_seconds": 0.05,
            "vocab_size": 32000,
        }
    ],
}


def wait_for_waiting(url: str, *, at_least: int, timeout_seconds: float = 20) -> None:
    query = f'sum(vllm:num_requests_waiting{{model_name="{ENGINE_MODEL}"}})'
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
        samples = result["data"]["result"]
        if samples and float(samples[0]["value"][1]) >= at_least:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus never saw {at_least} waiting requests: {result}")
        time.sleep(0.2)


def test_requests_waiting_in_the_engines_add_replicas(
    sellable, served_model, globex, settings, tmp_path
):
    served_model.engine_model_id = ENGINE_MODEL
    served_model.save()
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1, target_utilisation=1.0
    )
    # Metered use: 100 MU/min of 10 MU requests, one replica's worth (100 MU/min each).
    use(globex, served_model, 100)
    allocation_tick()
    assert Deployment.objects.get(name="llama-8b-h100").current_replicas == 1

    (tmp_path / "emulator").mkdir()
    (tmp_path / "prometheus").mkdir()
    with (
        emulator_process(EMULATOR_CONFIG, tmp_path / "emulator") as engine_url,
        prometheus_server(
            [engine_url.removeprefix("http://")], tmp_path / "prometheus"
        ) as prometheus_url,
    ):
        body = {"model": ENGINE_MODEL, "prompt": [1, 2, 3], "max_tokens": 100}
        streams = start_streams(engine_url, [{**body, "ignore_eos": True}] * 12)
        wait_for_samples(prometheus_url, "vllm:num_requests_waiting", count=1)
        wait_for_waiting(prometheus_url, at_least=6)
        settings.PROMETHEUS_URL = prometheus_url
        allocation_tick()
    # The streams end when the emulator does; wait for them so that nothing outlives the test.
    streams.exception(timeout=30)

    # At least 6 waiting requests of 10 MU on top of 100 MU/min: at least 2 replicas.
    assert Deployment.objects.get(name="llama-8b-h100").current_replicas >= 2
    latest = AllocationDecision.objects.order_by("-created_at").first()
    assert "best_effort" in {reason["code"] for reason in latest.reasons}
