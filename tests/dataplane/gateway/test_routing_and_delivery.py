"""Routing by least outstanding MU and bounded affinity, vLLM's priority only where the engine
schedules by it, holding requests for a model at zero, and the usage spool."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.support.recording_server import RecordingServer

from . import contract as C
from .conftest import bearer, set_limits, tiny_model, usage_events, wait_for

SLOW = {"seed": 0, "models": [tiny_model(decode_step_base_seconds=0.02)]}
SMALL = {"model": "tiny", "prompt": "x", "max_tokens": 2}
BIG = {"model": "tiny", "prompt": "a b", "max_tokens": 1000, "ignore_eos": True, "stream": True}


def counter(http: httpx.Client, url: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in http.get(url + "/metrics").text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def two_replicas(world, start_emulator, start_gateway):
    a, _ = start_emulator(SLOW)
    b, _ = start_emulator(SLOW)
    world.publication.models["tiny"] = C.model(
        7, [C.replica(a, deployment="a"), C.replica(b, deployment="b")]
    )
    world.publish()
    return a, b, start_gateway()


def hold_big(http, gateway, world, headers=None):
    """Start a long stream and keep it open (the line iterator too: dropping it closes the
    stream); returns (its context manager, the iterator)."""
    manager = http.stream(
        "POST",
        gateway.url + "/v1/completions",
        json=BIG,
        headers={**bearer(world.acme), **(headers or {})},
    )
    response = manager.__enter__()
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return manager, lines


def test_requests_go_to_the_replica_with_the_least_outstanding_mu(
    world, start_emulator, start_gateway, http, usage_server
):
    a, b, gateway = two_replicas(world, start_emulator, start_gateway)
    big, _lines = hold_big(http, gateway, world)
    busy, idle = (a, b) if counter(http, a, "vllm:num_requests_running") else (b, a)
    try:
        for _ in range(6):
            assert (
                http.post(
                    gateway.url + "/v1/completions", json=SMALL, headers=bearer(world.acme)
                ).status_code
                == 200
            )
    finally:
        big.__exit__(None, None, None)

    assert counter(http, idle, "vllm:prompt_tokens_total") == 6  # six one-token prompts
    assert counter(http, busy, "vllm:prompt_tokens_total") == 2  # only the big one


def test_a_session_sticks_to_one_replica_until_it_is_too_hot(
    world, start_emulator, start_gateway, http, usage_server
):
    _a, _b, gateway = two_replicas(world, start_emulator, start_gateway)
    session = {"X-Session-Id": "conversation-42"}
    for _ in range(4):
        http.post(
            gateway.url + "/v1/completions", json=SMALL, headers={**bearer(world.acme), **session}
        )
    events = wait_for(lambda: len(usage_events(usage_server)) == 4 and usage_events(usage_server))
    pinned = {e["deployment"] for e in events}
    assert len(pinned) == 1

    big, _lines = hold_big(http, gateway, world, session)  # lands on the pinned replica
    try:
        http.post(
            gateway.url + "/v1/completions", json=SMALL, headers={**bearer(world.acme), **session}
        )
    finally:
        big.__exit__(None, None, None)
    events = wait_for(lambda: len(usage_events(usage_server)) == 6 and usage_events(usage_server))
    small_after = [e for e in events[4:] if e["output_tokens"] <= 2 and e["outcome"] == "completed"]
    assert small_after and small_after[0]["deployment"] not in pinned


COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


def test_priority_is_forwarded_only_to_engines_that_schedule_by_it(world, start_gateway, http):
    with RecordingServer(body=COMPLETION) as plain, RecordingServer(body=COMPLETION) as priority:
        world.publication.models["tiny"] = C.model(7, [C.replica(plain.url)])
        world.publication.models["prio"] = C.model(
            9, [C.replica(priority.url, priority_scheduling=True)]
        )
        world.publication.entitlements[1] = ["tiny", "prio"]
        from .conftest import set_limits

        set_limits(world.rds, {(1, 7): (1000.0, 0.0), (1, 9): (0.0, 1000.0)})
        world.publish()
        gateway = start_gateway()
        for name in ("tiny", "prio"):
            response = http.post(
                gateway.url + "/v1/completions",
                json={**SMALL, "model": name, "priority": -5},
                headers=bearer(world.acme),
            )
            assert response.status_code == 200, response.text

        sent_plain = json.loads(plain.requests[0].body)
        sent_priority = json.loads(priority.requests[0].body)
    assert "priority" not in sent_plain  # not even the client's own
    assert sent_priority["priority"] == 1  # best-effort after guaranteed (0)


def test_a_model_at_zero_holds_the_request_records_the_demand_and_serves_once_a_replica_appears(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator()
    world.publication.models["tiny"] = C.model(7, [])
    world.publish()
    gateway = start_gateway()
    result = {}

    def send():
        result["response"] = http.post(
            gateway.url + "/v1/completions", json=SMALL, headers=bearer(world.acme)
        )

    sender = threading.Thread(target=send)
    sender.start()
    waiting = wait_for(lambda: world.rds.hget(C.WAITING, "tiny"))
    demand = json.loads(waiting)
    assert demand["requests"] == 1 and demand["mu"] > 0
    assert demand["since"] <= demand["updated_at"] <= time.time() + 1
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    sender.join(timeout=10)

    assert result["response"].status_code == 200
    assert world.rds.hget(C.WAITING, "tiny") is None
    assert wait_for(lambda: usage_events(usage_server))[0]["outcome"] == "completed"
    # It asked the control plane for a tick now, with its service key.
    (wake,) = [r for r in usage_server.requests if r.path == "/api/v1/allocation/wake"]
    assert json.loads(wake.body) == {"model": "tiny"}
    assert wake.headers["authorization"].endswith("test-service-key-for-usage")


def test_best_effort_at_zero_is_held_not_refused_until_its_first_allowance_arrives(
    world, start_emulator, start_gateway, http, usage_server
):
    # No reservation and, with no ready replica, no best-effort allowance yet: admission
    # would refuse it; a model at zero holds it instead, through the wake-up and the first
    # allowance of the replica that comes.
    url, _ = start_emulator()
    set_limits(world.rds, {(1, 7): (0.0, 0.0)})
    world.publication.models["tiny"] = C.model(7, [])
    world.publish()
    gateway = start_gateway()
    result = {}
    sender = threading.Thread(
        target=lambda: result.setdefault(
            "response",
            http.post(gateway.url + "/v1/completions", json=SMALL, headers=bearer(world.acme)),
        )
    )
    sender.start()
    wait_for(lambda: world.rds.hget(C.WAITING, "tiny"))
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    time.sleep(1.0)  # the replica is published; its allowance comes a tick later
    set_limits(world.rds, {(1, 7): (0.0, 1000.0)})
    sender.join(timeout=15)

    assert result["response"].status_code == 200
    (event,) = wait_for(lambda: usage_events(usage_server))
    assert (event["outcome"], event["admission_class"]) == ("completed", "best_effort")


def test_a_model_still_at_zero_after_the_cold_start_wait_is_a_503_and_a_refused_demand(
    world, start_gateway, http, usage_server
):
    world.publication.models["tiny"] = C.model(7, [])
    world.publish()
    gateway = start_gateway(GATEWAY_COLD_START_WAIT_SECONDS="1")

    response = http.post(gateway.url + "/v1/completions", json=SMALL, headers=bearer(world.acme))

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_not_ready"
    assert int(response.headers["Retry-After"]) >= 1
    (event,) = wait_for(lambda: usage_events(usage_server))
    assert event["outcome"] == "refused" and event["estimated_mu"] > 0


def test_events_are_spooled_while_the_control_plane_is_down_and_delivered_after(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator()
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    usage_server.status = 503
    gateway = start_gateway()
    ids = []
    for _ in range(3):
        response = http.post(
            gateway.url + "/v1/completions", json=SMALL, headers=bearer(world.acme)
        )
        ids.append(response.headers["X-Request-Id"])
    wait_for(lambda: world.rds.xlen(C.SPOOL) >= 1)

    usage_server.status = 200
    wait_for(lambda: world.rds.xlen(C.SPOOL) == 0)
    delivered = set()
    for request in usage_server.requests:
        delivered |= {e["event_id"] for e in json.loads(request.body)["events"]}
    assert set(ids) <= delivered
