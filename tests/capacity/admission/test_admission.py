"""Admission control against a real Redis: classes, limits from the tick, concurrency bounds,
reconciliation with usage events, Redis going away and coming back, clear 4xx answers."""

import subprocess
import threading
import time
from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from accounts import scopes as S
from capacity.admission import gate as admission
from capacity.admission.redis_layout import (
    FLOORS_INDEX,
    FLOORS_WRITTEN_KEY,
    LIMITS_TICK_KEY,
    OPEN_REQUESTS_KEY,
    floor_key,
    limits_key,
)
from capacity.allocation.policy import Allowance
from capacity.allocation.tick import allocation_tick
from capacity.models import Reservation
from tests.support.admission import publish_allowances, reserve
from tests.support.processes import free_port

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]

# With the fixtures' cost model (tests/conftest.py SIMPLE_WEIGHTS, R = 100): 100 prompt tokens
# and 10 output tokens take 0.1 + 0.2 + 0.05 = 0.35 replica-seconds, i.e. 0.35 × 100 / 60 MU.
SMALL = {"input_tokens": 100, "max_tokens": 10}
SMALL_MU = 0.35 * 100 / 60


def limits(customer, model, guaranteed, best_effort):
    publish_allowances([Allowance(customer.pk, model.pk, guaranteed, best_effort)])


def ask(customer, served_model, request_id=None, **shape):
    return admission.admit(
        customer_id=customer.pk,
        model=served_model.name,
        input_tokens=shape.get("input_tokens", SMALL["input_tokens"]),
        cached_input_tokens=shape.get("cached_input_tokens", 0),
        max_tokens=shape.get("max_tokens", SMALL["max_tokens"]),
        request_id=request_id,
    )


def warm_model_cache(served_model):
    # Threads run outside the test's transaction: the model must be known before they start.
    admission._model(served_model.name)


@pytest.fixture
def admission_client(make_key, acme, key_client):
    _, plaintext = make_key(customer=acme, scopes=[S.ADMISSION])
    return key_client(plaintext)


def test_within_the_reservation_is_guaranteed_then_best_effort_then_429(
    sellable, served_model, acme, admission_client
):
    # 6 MU/min reserved with a 10 s burst: 1 MU of burst, one small request (0.58 MU).
    limits(acme, served_model, 6.0, 3.0)
    body = {"model": "llama-8b", **SMALL}

    first = admission_client.post("/api/v1/admission", body | {"request_id": "r1"}, format="json")
    assert first.status_code == 200
    assert first.json()["class"] == "guaranteed"
    assert first.json()["priority"] == 0
    assert first.json()["estimated_mu"] == pytest.approx(SMALL_MU)
    assert first.json()["limits"]["guaranteed_mu_per_minute"] == 6.0

    second = admission_client.post("/api/v1/admission", body | {"request_id": "r2"}, format="json")
    assert (second.json()["class"], second.json()["priority"]) == ("best_effort", 1)

    refused = admission_client.post("/api/v1/admission", body | {"request_id": "r3"}, format="json")
    assert refused.status_code == 429
    assert refused.json()["admitted"] is False
    assert refused.json()["class"] == "refused"
    # The guaranteed bucket frees 0.58 MU at 0.1 MU/s in about 5.8 s, minus what has passed.
    assert 0 < refused.json()["retry_after_ms"] <= 6000
    assert int(refused["Retry-After"]) >= 1


def test_bad_input_is_a_clear_400_naming_the_field(sellable, served_model, admission_client):
    cases = [
        ({"model": "llama-8b", "input_tokens": 10, "cached_input_tokens": 20, "max_tokens": 5},
         "cached_input_tokens"),
        ({"model": "nope", "input_tokens": 10, "max_tokens": 5}, "model"),
        ({"model": "llama-8b", "input_tokens": -1, "max_tokens": 5}, "input_tokens"),
        ({"model": "llama-8b", "input_tokens": 10, "max_tokens": 0}, "max_tokens"),
        ({"model": "llama-8b", "input_tokens": "many", "max_tokens": 5}, "input_tokens"),
    ]  # fmt: skip
    for body, field in cases:
        response = admission_client.post("/api/v1/admission", body, format="json")
        assert response.status_code == 400, body
        assert field in response.json()["error"]["fields"], response.json()


def test_a_customer_asks_only_for_itself_and_needs_the_scope(
    sellable, served_model, acme, globex, admission_client, acme_key_client
):
    body = {"model": "llama-8b", **SMALL, "customer": "globex"}
    response = admission_client.post("/api/v1/admission", body, format="json")
    assert response.status_code == 400
    assert "customer" in response.json()["error"]["fields"]
    no_scope = acme_key_client.post("/api/v1/admission", {"model": "llama-8b", **SMALL})
    assert no_scope.status_code == 403


def test_a_platform_key_names_the_customer(sellable, served_model, acme, make_key, key_client):
    _, plaintext = make_key(service_name="gateway", scopes=[S.ADMISSION])
    gateway = key_client(plaintext)
    limits(acme, served_model, 600.0, 0.0)
    body = {"model": "llama-8b", **SMALL, "customer": "acme"}
    assert gateway.post("/api/v1/admission", body, format="json").json()["class"] == "guaranteed"
    missing = gateway.post("/api/v1/admission", {"model": "llama-8b", **SMALL}, format="json")
    assert missing.status_code == 400
    assert "customer" in missing.json()["error"]["fields"]


def test_admitted_guaranteed_mu_never_exceeds_rate_times_time_plus_burst(
    sellable, served_model, acme
):
    # 600 MU/min = 10 MU/s, burst 10 s = 100 MU; eight threads hammer for two seconds.
    limits(acme, served_model, 600.0, 0.0)
    warm_model_cache(served_model)
    admitted_mu = []
    lock = threading.Lock()
    stop = time.monotonic() + 2.0

    def hammer():
        mine = 0.0
        while time.monotonic() < stop:
            if ask(acme, served_model).admission_class == "guaranteed":
                mine += SMALL_MU
        with lock:
            admitted_mu.append(mine)

    started = time.monotonic()
    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    total = sum(admitted_mu)
    assert total <= 10.0 * elapsed + 100.0 + SMALL_MU
    assert total >= 100.0  # the burst at least, so the test measured the bound, not idling


def test_best_effort_traffic_never_starves_a_customer_under_its_reservation(
    sellable, served_model, acme, globex
):
    limits(acme, served_model, 600.0, 0.0)  # 10 MU/s reserved
    limits(globex, served_model, 0.0, 60.0)  # best-effort only, 1 MU/s
    warm_model_cache(served_model)
    stop = time.monotonic() + 1.5

    def flood():
        while time.monotonic() < stop:
            ask(globex, served_model)

    threads = [threading.Thread(target=flood) for _ in range(6)]
    for thread in threads:
        thread.start()
    classes = []
    while time.monotonic() < stop:  # acme at ~5 MU/s, half its reservation
        classes.append(ask(acme, served_model).admission_class)
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    assert classes and set(classes) == {"guaranteed"}


def test_usage_events_settle_generous_max_tokens(
    sellable, served_model, acme, make_key, key_client
):
    # max_tokens 1000 prices a request at (0.1 + 20 + 0.05) × 100 / 60 = 33.6 MU; 12 MU/min
    # reserved has a 2 MU burst, so the first request puts the bucket 31.6 MU in debt and the
    # next is refused. The request used 5 output tokens: once its usage event arrives, the
    # difference comes back and the customer is admitted again at once.
    limits(acme, served_model, 12.0, 0.0)
    generous = {"input_tokens": 100, "max_tokens": 1000}
    assert ask(acme, served_model, request_id="req-1", **generous).admitted
    assert not ask(acme, served_model, **SMALL).admitted

    _, plaintext = make_key(service_name="gateway", scopes=[S.USAGE_WRITE])
    now = timezone.now()
    event = {
        "event_id": "req-1",
        "customer": "acme",
        "model": "llama-8b",
        "started_at": (now - timedelta(seconds=2)).isoformat(),
        "finished_at": now.isoformat(),
        "input_tokens": 100,
        "output_tokens": 5,
        "outcome": "completed",
        "admission_class": "guaranteed",
    }
    stored = key_client(plaintext).post("/api/v1/usage/events", {"events": [event]}, format="json")
    assert stored.status_code == 200
    assert ask(acme, served_model, **SMALL).admission_class == "guaranteed"
    # The same event again is a duplicate and settles nothing twice.
    ask(acme, served_model, **SMALL)
    again = key_client(plaintext).post("/api/v1/usage/events", {"events": [event]}, format="json")
    assert again.json()["duplicate_count"] == 1
    assert not ask(acme, served_model, **SMALL).admitted


def test_the_estimate_caps_max_tokens_at_recent_output_lengths(sellable, served_model, acme):
    from capacity.models import UsageEvent

    now = timezone.now()
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=f"past-{i}",
            customer=acme,
            served_model=served_model,
            started_at=now - timedelta(seconds=10),
            finished_at=now - timedelta(seconds=5),
            minute=(now - timedelta(seconds=5)).replace(second=0, microsecond=0),
            input_tokens=100,
            output_tokens=20,
            outcome="completed",
            admission_class="guaranteed",
            mu=1.0,
            cost_model=sellable,
            ingested_at=now,
        )
        for i in range(50)
    )
    limits(acme, served_model, 6000.0, 0.0)
    decision = ask(acme, served_model, input_tokens=100, max_tokens=4000)
    assert decision.estimated_mu == pytest.approx((0.1 + 20 * 0.02 + 0.05) * 100 / 60)


def test_output_caps_of_many_models_are_each_models_own(sellable, served_model, acme):
    """The gateway documents read every model's cap in one query: the same figure as one
    model's, and None for a model without completed outputs."""
    from capacity.models import UsageEvent

    now = timezone.now()
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=f"cap-{i}",
            customer=acme,
            served_model=served_model,
            started_at=now - timedelta(seconds=60 - i),
            finished_at=now - timedelta(seconds=30 - i),
            minute=(now - timedelta(seconds=30)).replace(second=0, microsecond=0),
            input_tokens=100,
            output_tokens=5 + 7 * i,
            outcome="completed" if i % 5 else "refused",
            admission_class="guaranteed",
            mu=1.0,
            cost_model=sellable,
            ingested_at=now,
        )
        for i in range(25)
    )
    caps = admission.output_caps_tokens([served_model.pk, served_model.pk + 1000])
    assert caps[served_model.pk] == admission.output_cap_tokens(served_model.pk)
    assert caps[served_model.pk] is not None
    assert caps[served_model.pk + 1000] is None


def test_a_reservation_reaches_admission_with_the_next_tick(sellable, served_model, acme):
    assert ask(acme, served_model).admission_class == "refused"
    reservation = Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=120,
        starts_at=timezone.now() - timedelta(minutes=1),
        status="active",
    )
    allocation_tick()
    assert ask(acme, served_model).admission_class == "guaranteed"
    reservation.status = "cancelled"
    reservation.save()
    allocation_tick()
    assert ask(acme, served_model).admission_class != "guaranteed"


def test_limit_and_bucket_keys_expire_and_only_an_open_ended_floor_lasts(
    sellable, served_model, acme, clean_admission
):
    limits(acme, served_model, 600.0, 0.0)
    ask(acme, served_model, request_id="r-expire")
    keys = {key.decode() for key in clean_admission.scan_iter("adm:*")}
    assert keys
    # What a sale guarantees lasts as long as the sale (open-ended here), the tick's
    # heartbeat and the indexes are single keys; everything per request or per tick expires.
    lasting = {
        floor_key(acme.pk, served_model.pk),
        FLOORS_INDEX,
        FLOORS_WRITTEN_KEY,
        LIMITS_TICK_KEY,
        OPEN_REQUESTS_KEY,
    }
    for key in keys - lasting:
        assert clean_admission.pttl(key) > 0, key
    assert clean_admission.pttl(floor_key(acme.pk, served_model.pk)) == -1


@pytest.fixture
def private_redis(tmp_path, settings):
    port = free_port()

    def start():
        return subprocess.Popen(
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip

    process = start()
    url = f"redis://127.0.0.1:{port}/0"
    _wait_for(url)
    settings.ADMISSION_REDIS_URL = url
    admission.reset()
    holder = {"process": process}

    def stop():
        holder["process"].terminate()
        holder["process"].wait(timeout=10)

    def restart():
        holder["process"] = start()
        _wait_for(url)

    yield stop, restart
    if holder["process"].poll() is None:
        stop()


def _wait_for(url):
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_redis_down_admits_reserved_customers_from_a_local_bucket_and_recovers(
    sellable, served_model, acme, globex, private_redis, client
):
    stop, restart = private_redis
    # What is sold, not any tick's allowance, is what the fallback admits by: no tick runs here.
    reserve(acme, served_model, 600.0)
    for customer, guaranteed, best_effort in ((acme, 600.0, 0.0), (globex, 0.0, 600.0)):
        limits(customer, served_model, guaranteed, best_effort)
    assert ask(globex, served_model).admission_class == "best_effort"

    stop()
    reserved = ask(acme, served_model)
    assert (reserved.admitted, reserved.admission_class, reserved.degraded) == (
        True,
        "guaranteed",
        True,
    )
    best_effort = ask(globex, served_model)
    assert (best_effort.admitted, best_effort.degraded) == (False, True)
    # The local bucket holds the reservation: 100 MU of burst, not more.
    admitted = sum(ask(acme, served_model).admitted for _ in range(400))
    assert admitted * SMALL_MU <= 100.0 + 10.0 + SMALL_MU
    assert "controlplane_admission_degraded_total" in client.get("/metrics").content.decode()

    restart()
    limits(globex, served_model, 0.0, 600.0)  # the next tick rewrites what Redis lost
    recovered = ask(globex, served_model)
    assert (recovered.admission_class, recovered.degraded) == ("best_effort", False)


def test_metrics_count_decisions(sellable, served_model, acme, client):
    limits(acme, served_model, 600.0, 0.0)
    ask(acme, served_model)
    text = client.get("/metrics").content.decode()
    assert (
        'controlplane_admission_decisions_total{admission_class="guaranteed",outcome="admitted"}'
        in text
    )
    assert limits_key(acme.pk, served_model.pk).startswith("adm:")


def test_with_four_fallback_processes_one_admits_at_most_a_quarter_of_the_burst_while_redis_is_down(
    sellable, served_model, acme, private_redis, settings
):
    stop, _ = private_redis
    settings.ADMISSION_FALLBACK_PROCESSES = 4
    reserve(acme, served_model, 600.0)  # burst: 100 MU over every process
    limits(acme, served_model, 600.0, 0.0)
    stop()

    started = time.monotonic()
    decisions = [ask(acme, served_model) for _ in range(200)]
    elapsed = time.monotonic() - started
    assert all(decision.degraded for decision in decisions)
    admitted_mu = sum(decision.admitted for decision in decisions) * SMALL_MU
    # A quarter of the 100 MU burst, plus what a quarter of the rate refilled meanwhile.
    refilled = 150.0 / 60 * elapsed
    assert admitted_mu <= 25.0 + refilled + SMALL_MU
    assert admitted_mu >= 25.0 - SMALL_MU
