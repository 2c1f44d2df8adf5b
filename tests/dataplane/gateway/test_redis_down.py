"""Redis down at the gateway: bounded, recorded (issue 33, item 3).

While its Redis cannot be reached, each gateway worker admits a customer up to its share of
the customer's reservation floor (the contract's gw:v1:reservations, the copy it read last)
from a bucket of its own, refuses best-effort, and sends what it decided with each usage event
(`fallback_class`), since no admission record can be written. Nothing admits without bound.
"""

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from capacity.pricing.features import mu_of, replica_seconds_of
from tests.dataplane.gateway import contract as C
from tests.dataplane.gateway.conftest import (
    bearer,
    set_limits,
    usage_events,
    wait_for,
    wait_for_workers,
)
from tests.support.processes import free_port

pytestmark = pytest.mark.serial  # a minute of wall time, measured against a rate

RESERVED_MU_PER_MINUTE = 3.0
OUTAGE_SECONDS = 60.0
# 20 prompt tokens (bytes / 4) and at most 16 out: what the gateway estimates and charges.
BODY = {"model": "tiny", "prompt": "x" * 80, "max_tokens": 16}


def estimated_mu() -> float:
    seconds = replica_seconds_of(C.WEIGHTS, input_tokens=20, output_tokens=16)
    return mu_of(seconds, 100.0)


@pytest.fixture
def redis_server(tmp_path):
    """A Redis of the test's own, stopped and started again by it."""
    port = free_port()
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
               "--dir", str(tmp_path)]  # fmt: skip
    holder = {"process": subprocess.Popen(command, stdout=subprocess.DEVNULL)}
    url = f"redis://127.0.0.1:{port}/0"

    def client():
        import redis

        return redis.Redis.from_url(url)

    wait_for(lambda: _pings(client()))

    def stop():
        holder["process"].terminate()
        holder["process"].wait(timeout=10)

    def start():
        holder["process"] = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        wait_for(lambda: _pings(client()))

    yield url, client, stop, start
    if holder["process"].poll() is None:
        stop()


def _pings(client) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_with_redis_stopped_for_a_minute_a_reserved_customer_gets_at_most_its_reservation_and_best_effort_nothing(  # noqa: E501
    redis_server, start_emulator, start_gateway, usage_server
):
    url, client, stop, start = redis_server
    rds = client()
    engine, _ = start_emulator()
    acme = C.key(customer_id=1, customer="acme")
    globex = C.key(customer_id=2, customer="globex")
    C.publish(
        rds,
        C.Publication(
            keys={acme.prefix: acme.doc, globex.prefix: globex.doc},
            models={"tiny": C.model(7, [C.replica(engine)])},
            entitlements={1: ["tiny"], 2: ["tiny"]},
            reservations={1: {"tiny": RESERVED_MU_PER_MINUTE}},
        ),
    )
    set_limits(rds, {(1, 7): (RESERVED_MU_PER_MINUTE, 0.0), (2, 7): (0.0, 600.0)})
    # Two workers, each admitting half of a reservation while Redis is down.
    gateway = start_gateway(GATEWAY_REDIS_URL=url, GATEWAY_WORKERS="2")
    # Both workers have read the contract (each beats once it has, before it listens). The
    # gateway answers /readyz from whichever worker is up first; on a loaded machine the other
    # was still starting when Redis stopped, read no contract, and answered its half of the
    # outage's requests 503 with no usage event, so the events awaited below never all came.
    wait_for_workers(rds, 2)
    with httpx.Client(timeout=30, trust_env=False) as http:
        assert (
            http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(globex))
        ).status_code == 200  # best-effort while Redis answers
    stop()
    sent = {"acme": [], "globex": []}

    def send(who, key, rate_per_second, seconds):
        # Fresh connections: the kernel spreads them over both workers (SO_REUSEPORT).
        deadline = time.monotonic() + seconds
        period = 1.0 / rate_per_second
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            with httpx.Client(timeout=30, trust_env=False) as http:
                answer = http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(key))
            sent[who].append(answer.status_code)
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))

    started = time.monotonic()
    # acme asks three times its reservation (0.058 MU a request, 3 MU/min: ~51 a minute).
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(send, "acme", acme, 2.5, OUTAGE_SECONDS),
            pool.submit(send, "globex", globex, 1.0, OUTAGE_SECONDS),
        ]
        for future in futures:
            future.result()
    elapsed = time.monotonic() - started
    start()
    # Admitted or refused by the fallback, each with its event; never "not ready" (503).
    assert set(sent["acme"]) | set(sent["globex"]) <= {200, 429}, sent

    events = wait_for(
        lambda: (
            len(found := usage_events(usage_server)) >= 1 + sum(map(len, sent.values())) and found
        ),
        timeout_seconds=30,
    )
    outage = [e for e in events if "fallback_class" in e]
    acme_admitted = [e for e in outage if e["customer"] == "acme" and e["outcome"] == "completed"]
    admitted_mu = len(acme_admitted) * estimated_mu()
    reservation_mu = RESERVED_MU_PER_MINUTE * elapsed / 60
    # Each worker's bucket: half the rate and half the 10 s burst.
    burst_mu = RESERVED_MU_PER_MINUTE * 10 / 60
    print(
        f"\nRedis down {elapsed:.0f} s: the fallback admitted {admitted_mu:.2f} MU of acme "
        f"({len(acme_admitted)} of {len(sent['acme'])} requests) against its reservation's "
        f"{reservation_mu:.2f} MU (+{burst_mu:.2f} MU of burst); globex (best-effort) "
        f"{sum(1 for s in sent['globex'] if s == 200)} of {len(sent['globex'])} admitted"
    )
    assert admitted_mu <= reservation_mu + burst_mu + estimated_mu()
    # It asked three times more, so its share is used: most of the reservation is admitted.
    assert admitted_mu >= 0.8 * reservation_mu
    assert all(status == 429 for status in sent["globex"]), sent["globex"]
    assert {e["fallback_class"] for e in acme_admitted} == {"guaranteed"}
    acme_refused = [e for e in outage if e["customer"] == "acme" and e["outcome"] == "refused"]
    assert {e["fallback_class"] for e in acme_refused} == {"refused_guaranteed"}
    assert {e["fallback_class"] for e in outage if e["customer"] == "globex"} == {"refused"}
    # Every request left its one event, decided by the fallback.
    assert len(outage) == sum(map(len, sent.values()))
