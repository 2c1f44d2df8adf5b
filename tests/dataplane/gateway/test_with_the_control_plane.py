"""The gateway in front of the real control plane: the contract comes from the control plane's
own publisher (after a real probe round and allocation tick), usage goes to the real API
(gunicorn on the test database), and every request leaves exactly one usage event with its
outcome — also across a spell with the control plane's web server down (the Redis spool)."""

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import redis
from django.conf import settings

from accounts import scopes as S
from capacity.admission.gate import buckets
from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_round
from capacity.models import ActuatorKind, Deployment, Replica, UsageEvent
from capacity.publication.publish import publish_gateway_state
from capacity.selling.entitlements import entitlements_set
from capacity.selling.reservations import reservation_create
from tests.support import processes
from tests.support.processes import ROOT, free_port
from tests.support.subprocesses import stop, wait_until_answering

from .conftest import gateway_process, tiny_model, wait_for

# Long enough to leave after the first token (2 ms a step), small enough to fit acme's bucket.
CANCELLED_MAX_TOKENS = 300

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql_only]


@contextmanager
def control_plane(tmp_path, port: int):
    """gunicorn serving the control plane on the test database, on a chosen port (so it can be
    stopped and started again where the gateway looks for it)."""
    log_path = tmp_path / f"gunicorn-{port}-{time.monotonic_ns()}.log"
    env = os.environ | {"DATABASE_URL": processes.test_database_url(), "SECURE_SSL_REDIRECT": "0"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "controlplane.wsgi:application",
             "--bind", f"127.0.0.1:{port}", "--workers", "2", "--timeout", "60"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url + "/healthz", process, what="gunicorn", log_path=log_path)
        yield url
    finally:
        stop(process)


@pytest.fixture
def fleet(sellable, served_model, acme, globex, make_key, tmp_path, start_emulator):
    """llama-8b served by one emulator replica that the probes found healthy; acme holds a
    reservation, globex none; both may use the model; the gateway's service key."""
    emulator_url, _ = start_emulator(
        {"seed": 0, "models": [tiny_model(name=served_model.engine_model_id)]}
    )
    Deployment.objects.filter(served_model=served_model).update(
        actuator_kind=ActuatorKind.DRY_RUN, endpoint_url=emulator_url, current_replicas=1
    )
    for customer in (acme, globex):
        entitlements_set(customer=customer, served_models=[served_model], actor="test")
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=300, actor="test")
    probe_round()  # the real probes: the replica answers and becomes ready
    assert Replica.objects.filter(state=Replica.State.HEALTHY).count() == 1
    allocation_tick()  # admission limits and the gateway contract, as every 15 s
    # No best-effort capacity for anyone: globex, without a reservation, is always refused.
    buckets().publish_limits(
        {(acme.pk, served_model.pk): (300.0, 0.0), (globex.pk, served_model.pk): (0.0, 0.0)},
        settings.ADMISSION_LIMITS_TTL_SECONDS,
    )
    assert publish_gateway_state(reason="test") is not None
    _, acme_key = make_key(customer=acme, scopes=[S.READ, S.ADMISSION])
    _, globex_key = make_key(customer=globex, scopes=[S.READ, S.ADMISSION])
    _, service_key = make_key(service_name="gateway", scopes=[S.USAGE_WRITE])
    return {"acme": acme_key, "globex": globex_key, "service": service_key,
            "model": served_model.name, "emulator": emulator_url}  # fmt: skip


def _complete(client, gateway_url, key, model, *, stream: bool, max_tokens: int = 6):
    """One request; (request id, status, usage the client saw or None)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        response = client.post(gateway_url + "/v1/chat/completions", json=body, headers=headers)
        usage = response.json().get("usage") if response.status_code == 200 else None
        return response.headers.get("x-request-id"), response.status_code, usage
    usage = None
    with client.stream(
        "POST", gateway_url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return response.headers.get("x-request-id"), response.status_code, usage


def _cancel_mid_stream(gateway_url, key, model):
    """A client that leaves after the first token of a long answer; its request id."""
    body = {"model": model, "messages": [{"role": "user", "content": "a long one"}],
            "max_tokens": CANCELLED_MAX_TOKENS, "stream": True}  # fmt: skip
    with httpx.Client(timeout=30, trust_env=False) as client, client.stream(
        "POST", gateway_url + "/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return response.headers.get("x-request-id")
    raise AssertionError("no token before leaving")


def test_every_request_leaves_one_usage_event_with_its_outcome_even_with_the_api_down(
    fleet, tmp_path
):
    port = free_port()
    expected: dict[str, tuple[str, dict | None]] = {}  # request id -> (outcome, usage seen)

    def send_mix(client, gateway_url, rounds: int) -> None:
        for i in range(rounds):
            for stream in (False, True):
                rid, status, usage = _complete(
                    client, gateway_url, fleet["acme"], fleet["model"], stream=stream
                )
                assert status == 200, status
                expected[rid] = ("completed", usage)
            rid, status, _ = _complete(
                client, gateway_url, fleet["globex"], fleet["model"], stream=bool(i % 2)
            )
            assert status == 429
            expected[rid] = ("refused", None)
        expected[_cancel_mid_stream(gateway_url, fleet["acme"], fleet["model"])] = (
            "cancelled",
            None,
        )

    with control_plane(tmp_path, port) as api_url, gateway_process(
        tmp_path,
        GATEWAY_CONTROL_PLANE_URL=api_url,
        GATEWAY_SERVICE_KEY=fleet["service"],
        GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
    ) as gateway, httpx.Client(timeout=30, trust_env=False) as client:  # fmt: skip
        send_mix(client, gateway.url, rounds=3)
        wait_for(lambda: UsageEvent.objects.count() == len(expected), timeout_seconds=20)

    # The control plane's web server is down: the gateway keeps serving and spools the events.
    spool = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    with gateway_process(
        tmp_path,
        GATEWAY_CONTROL_PLANE_URL=f"http://127.0.0.1:{port}",
        GATEWAY_SERVICE_KEY=fleet["service"],
        GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
    ) as gateway, httpx.Client(timeout=30, trust_env=False) as client:  # fmt: skip
        before_outage = len(expected)
        send_mix(client, gateway.url, rounds=2)
        depth = wait_for(lambda: spool.xlen("gw:v1:spool"), timeout_seconds=10)
        print(f"spool depth while the API was down: {depth} batch(es)")
        assert UsageEvent.objects.count() == before_outage
        with control_plane(tmp_path, port):
            wait_for(lambda: UsageEvent.objects.count() == len(expected), timeout_seconds=30)
            wait_for(lambda: spool.xlen("gw:v1:spool") == 0, timeout_seconds=10)
            time.sleep(1.5)  # a redelivery would show up as a second row by now: there is none

    events = {e.event_id: e for e in UsageEvent.objects.all()}
    assert set(events) == set(expected)
    for request_id, (outcome, usage) in expected.items():
        event = events[request_id]
        assert event.outcome == outcome, (request_id, event.outcome, outcome)
        if outcome == "completed":
            # The engine's own counts, as the client saw them.
            assert (event.input_tokens, event.output_tokens) == (
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
            assert event.admission_class == "guaranteed" and event.verification == "recorded"
        if outcome == "refused":
            assert event.mu == 0 and event.estimated_mu > 0
        if outcome == "cancelled":
            assert 1 <= event.output_tokens < CANCELLED_MAX_TOKENS


def test_a_guaranteed_customer_within_its_reservation_is_never_refused_while_best_effort_floods(
    fleet, acme, globex, served_model, tmp_path
):
    # globex lives off the fleet's slack (best-effort only); acme holds 300 MU/min.
    buckets().publish_limits(
        {(acme.pk, served_model.pk): (300.0, 0.0), (globex.pk, served_model.pk): (0.0, 30.0)},
        settings.ADMISSION_LIMITS_TTL_SECONDS,
    )
    port = free_port()
    outcomes: dict[str, list[int]] = {"acme": [], "globex": []}

    def flood(who: str, count: int) -> None:
        with httpx.Client(timeout=30, trust_env=False) as client:
            for _ in range(count):
                _, status, _ = _complete(
                    client, gateway.url, fleet[who], fleet["model"], stream=False, max_tokens=20
                )
                outcomes[who].append(status)

    with control_plane(tmp_path, port) as api_url, gateway_process(
        tmp_path,
        GATEWAY_CONTROL_PLANE_URL=api_url,
        GATEWAY_SERVICE_KEY=fleet["service"],
        GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
        GATEWAY_WORKERS="2",
    ) as gateway:  # fmt: skip
        # Best-effort floods from four clients at once while acme sends well within its rate
        # (20 requests of about 0.6 MU against 300 MU/min and a 50 MU burst).
        floods = [threading.Thread(target=flood, args=("globex", 25)) for _ in range(4)]
        for thread in floods:
            thread.start()
        flood("acme", 20)
        for thread in floods:
            thread.join()

    assert outcomes["acme"] == [200] * 20
    assert 429 in outcomes["globex"] and 200 in outcomes["globex"]
