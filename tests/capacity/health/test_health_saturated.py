"""Probes on saturated engines with no faults never mark a replica unhealthy: they run at
the highest priority, so a full batch delays them by a slot, not by the whole queue. The
same probe at the traffic's own priority would time out (the seeds' false kills)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from capacity.health.probes import probe_endpoint, probe_round
from capacity.models import Incident, ProbeResult, Replica
from tests.capacity.health.test_health_probes import process_deployment  # noqa: F401 - fixture
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    emulator_command,
    engines,
    http_supervisor,
    supervisor,
)
from tests.support.saturation import Saturator, waiting_requests

# Measures real latency under load: runs alone, not beside another test worker.
pytestmark = [pytest.mark.django_db, pytest.mark.serial]

# Long enough for a dozen rounds at full saturation; `make bench` runs ten minutes.
RUN_SECONDS = 8


def _probe_for(seconds: float) -> int:
    """A probe round every second for `seconds`; returns how many ran."""
    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline:
        started = time.monotonic()
        probe_round()
        rounds += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    return rounds


def test_saturated_replicas_are_never_marked_unhealthy(
    process_deployment,  # noqa: F811
    settings,
):
    settings.HEALTH_PROBE_QUIET_SECONDS = 0  # probe every round although requests complete
    timeout = settings.HEALTH_PROBE_TIMEOUT_SECONDS  # the default, 5 s
    probe_round()  # fingerprint while idle
    base_port = process_deployment.actuator_config["base_port"]
    urls = [f"http://127.0.0.1:{base_port + i}" for i in range(2)]
    # 8 sequences per batch (TINY_MODEL), 48 streams of ~1.3 s each per replica: a queue of
    # 40, about 6.5 s deep.
    with Saturator(urls, model="tiny", streams_per_url=48, max_tokens=600) as load:
        time.sleep(3)
        assert min(waiting_requests(url) for url in urls) >= 20, "not saturated"
        # Beside the rounds, the same probe at the traffic's own priority.
        with ThreadPoolExecutor(max_workers=1) as pool:
            naive = pool.submit(
                probe_endpoint, urls[0], "tiny", timeout_seconds=timeout, priority=None
            )
            rounds = _probe_for(RUN_SECONDS)
            naive = naive.result()
        assert min(waiting_requests(url) for url in urls) >= 20, "not saturated to the end"
    assert load.completed > 50 and load.errors == 0
    outcomes = list(ProbeResult.objects.exclude(latency_ms=None).values_list("outcome", flat=True))
    assert len(outcomes) >= 2 * rounds
    assert set(outcomes) == {"ok"}
    assert not Incident.objects.exists()
    assert set(Replica.objects.values_list("state", flat=True)) == {"healthy"}
    latencies = sorted(ProbeResult.objects.values_list("latency_ms", flat=True))
    assert latencies[int(0.99 * (len(latencies) - 1))] < timeout * 1000 / 2
    # The same probe at the traffic's priority waits behind the whole queue and times out.
    assert naive.outcome == "timeout"
