"""One request through the real gateway: authentication, entitlement, admission, the engine's
answer and the request's one usage event."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from capacity.admission.redis_buckets import Buckets
from capacity.admission.redis_layout import api_key_scope, customer_scope, in_flight_key
from tests.support.processes import free_port

from . import contract as C
from .conftest import bearer, set_limits, tiny_model, usage_events, wait_for, wait_for_workers

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def served(world, start_emulator, start_gateway):
    """acme may use `tiny`, served by one emulator replica, behind a running gateway."""
    url, _process = start_emulator()
    world.publication.models["tiny"] = C.model(7, [C.replica(url, deployment="tiny-a")])
    world.publish()
    gateway = start_gateway()
    return world, gateway, url


def emulator_counter(http: httpx.Client, url: str, name: str) -> float:
    total = 0.0
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_chat_completion_answers_with_the_engines_tokens_and_leaves_one_completed_event(
    served, http, usage_server
):
    world, gateway, url = served
    response = http.post(
        gateway.url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": 8},
        headers=bearer(world.acme),
    )

    assert response.status_code == 200, response.text
    body = response.json()
    request_id = response.headers["X-Request-Id"]
    events = wait_for(lambda: usage_events(usage_server))
    assert len(events) == 1
    event = events[0]
    assert event["event_id"] == request_id
    assert event["outcome"] == "completed"
    assert event["customer"] == "acme"
    assert event["model"] == "tiny"
    assert event["deployment"] == "tiny-a"
    assert event["admission_class"] == "guaranteed"
    assert event["input_tokens"] == body["usage"]["prompt_tokens"] == 2
    assert event["output_tokens"] == body["usage"]["completion_tokens"]
    assert event["output_tokens"] == emulator_counter(http, url, "vllm:generation_tokens_total")
    # The prompt's bytes beside the engine's count: the model's bytes-per-token calibration.
    assert event["prompt_bytes"] == len(b"hello there")
    assert usage_server.requests[0].headers["authorization"].endswith("test-service-key-for-usage")


def test_a_completion_is_served_too(served, http, usage_server):
    world, gateway, _url = served
    response = http.post(
        gateway.url + "/v1/completions",
        json={"model": "tiny", "prompt": "one two three", "max_tokens": 4},
        headers=bearer(world.acme),
    )

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 3
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert (event["input_tokens"], event["outcome"]) == (3, "completed")


def test_models_lists_only_what_the_key_may_use(served, http):
    world, gateway, url = served
    world.publication.models["other"] = C.model(8, [C.replica(url)])
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    listed = http.get(gateway.url + "/v1/models", headers=bearer(world.acme))

    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["tiny"]


@pytest.mark.parametrize(
    "headers, status, code",
    [
        ({}, 401, "missing_api_key"),
        ({"Authorization": "Bearer mu123.nope"}, 401, "invalid_api_key"),
        ({"Authorization": "Basic abc"}, 401, "invalid_api_key"),
    ],
    ids=["missing", "unknown", "not-bearer"],
)
def test_a_request_without_a_good_key_is_refused(served, http, headers, status, code):
    _world, gateway, _url = served
    response = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)

    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["type"] == "authentication_error"


def test_a_wrong_secret_for_a_known_prefix_is_refused(served, http):
    world, gateway, _url = served
    forged = world.acme.prefix + ".not-the-secret"
    response = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(forged))
    assert response.status_code == 401


def test_a_revoked_key_stops_working_within_5_seconds(served, http):
    world, gateway, _url = served
    assert (
        http.post(
            gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
        ).status_code
        == 200
    )
    world.publication.keys[world.acme.prefix] = {**world.acme.doc, "revoked": True}
    world.publish()
    revoked_at = time.monotonic()

    def refused() -> bool:
        r = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme))
        return r.status_code == 401 and r.json()["error"]["code"] == "revoked_api_key"

    wait_for(refused, timeout_seconds=5)
    assert time.monotonic() - revoked_at < 5


def test_an_expired_key_is_refused(world, start_emulator, start_gateway, http):
    url, _ = start_emulator()
    old = C.key(customer_id=1, customer="acme", expires_at=time.time() - 1)
    world.publication.keys[old.prefix] = old.doc
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    gateway = start_gateway()

    response = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(old))

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "expired_api_key"


def test_a_key_without_the_admission_scope_is_refused(world, start_emulator, start_gateway, http):
    url, _ = start_emulator()
    reader = C.key(customer_id=1, customer="acme", scopes=("read",))
    world.publication.keys[reader.prefix] = reader.doc
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    gateway = start_gateway()

    response = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(reader))

    assert response.status_code == 403
    assert response.json()["error"]["code"] == "insufficient_scope"


def test_a_customer_key_cannot_use_a_model_outside_its_entitlements(served, http, usage_server):
    world, gateway, url = served
    world.publication.models["other"] = C.model(8, [C.replica(url)])
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    response = http.post(
        gateway.url + "/v1/chat/completions",
        json={**CHAT, "model": "other"},
        headers=bearer(world.acme),
    )

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_customer_key_cannot_name_another_customer(served, http):
    world, gateway, _url = served
    response = http.post(
        gateway.url + "/v1/chat/completions",
        json=CHAT,
        headers={**bearer(world.acme), "X-MU-Customer": "globex"},
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "not_permitted"


def test_a_service_key_names_the_customer_it_sends_for(served, http, usage_server):
    world, gateway, _url = served
    service = C.key(kind="service", scopes=("admission", "usage:write"))
    world.publication.keys[service.prefix] = service.doc
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    unnamed = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(service))
    named = http.post(
        gateway.url + "/v1/chat/completions",
        json=CHAT,
        headers={**bearer(service), "X-MU-Customer": "acme"},
    )

    assert unnamed.status_code == 400
    assert unnamed.json()["error"]["code"] == "customer_required"
    assert named.status_code == 200
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert event["customer"] == "acme"


def test_a_service_key_without_admission_sends_nothing_and_one_with_it_only_what_the_customer_may(
    served, http, usage_server
):
    """Issue 34, finding 2: a `read` service key naming globex got a completion billed to
    globex, for a model globex may not use."""
    world, gateway, _url = served
    reader = C.key(kind="service", scopes=("read",))
    sender = C.key(kind="service", scopes=("admission", "usage:write"))
    globex = C.key(customer_id=2, customer="globex")
    for key in (reader, sender, globex):
        world.publication.keys[key.prefix] = key.doc
    world.publication.entitlements[2] = []  # globex may use no model
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    def send(key, customer):
        return http.post(
            gateway.url + "/v1/chat/completions",
            json=CHAT,
            headers={**bearer(key), "X-MU-Customer": customer},
        )

    read_only = send(reader, "globex")
    assert read_only.status_code == 403
    assert read_only.json()["error"]["code"] == "insufficient_scope"
    not_entitled = send(sender, "globex")
    assert not_entitled.status_code == 404
    assert not_entitled.json()["error"]["code"] == "model_not_found"
    assert send(sender, "acme").status_code == 200  # acme may use tiny
    time.sleep(0.5)  # a flush: only acme's request left an event
    assert [e["customer"] for e in usage_events(usage_server)] == ["acme"]


def test_admission_refusal_is_a_429_with_retry_after_and_a_refused_event(
    served, http, usage_server
):
    world, gateway, _url = served
    # 0.5 MU/min and no best-effort: the first request takes the burst, the next waits.
    set_limits(world.rds, {(1, 7): (0.5, 0.0)})
    statuses = []
    for _ in range(4):
        response = http.post(
            gateway.url + "/v1/chat/completions",
            json={**CHAT, "max_tokens": 64},
            headers=bearer(world.acme),
        )
        statuses.append(response.status_code)
    refused = response

    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    events = wait_for(lambda: len(usage_events(usage_server)) == 4 and usage_events(usage_server))
    refused_events = [e for e in events if e["outcome"] == "refused"]
    assert len(refused_events) == statuses.count(429)
    assert all(e["estimated_mu"] > 0 and e["output_tokens"] == 0 for e in refused_events)
    # Its tokens are estimates, not an engine's count: nothing to calibrate with.
    assert not any("prompt_bytes" in e for e in refused_events)
    assert refused.headers["X-Request-Id"] in {e["event_id"] for e in refused_events}


def test_a_keys_request_limits_bind_its_slot_frees_at_each_end_and_a_429_names_the_limit(
    served, http, usage_server
):
    world, gateway, _url = served
    # One request in flight and three a minute for acme's key (the control plane's writer).
    scope = api_key_scope(world.acme.prefix)
    Buckets(world.rds, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600)\
        .publish_request_limits({scope: {"concurrency": 1, "rpm": 3}})  # fmt: skip
    statuses = []
    for _ in range(4):
        response = http.post(
            gateway.url + "/v1/chat/completions",
            json={**CHAT, "max_tokens": 8},
            headers=bearer(world.acme),
        )
        statuses.append(response.status_code)
    # One at a time, each freed its slot as it ended (the usage server here frees nothing).
    assert statuses == [200, 200, 200, 429], statuses
    error = response.json()["error"]
    assert (error["code"], error["limit"], error["limit_scope"]) == (
        "rpm_limit_exceeded",
        "rpm",
        "api_key",
    )
    assert 50 <= int(response.headers["Retry-After"]) <= 60
    assert world.rds.zcard(in_flight_key(scope)) == 0
    events = wait_for(lambda: len(usage_events(usage_server)) == 4 and usage_events(usage_server))
    assert [e["outcome"] for e in events].count("refused") == 1


def test_a_customers_concurrency_limit_refuses_the_second_request_in_flight_until_the_first_ends(
    world, start_emulator, start_gateway, http, usage_server
):
    # 20 ms a token: a 50-token answer stays in flight for a second.
    url, _process = start_emulator(
        {"seed": 0, "models": [tiny_model(decode_step_base_seconds=0.02)]}
    )
    world.publication.models["tiny"] = C.model(7, [C.replica(url, deployment="tiny-a")])
    world.publish()
    gateway = start_gateway()
    scope = customer_scope(1)
    Buckets(world.rds, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600)\
        .publish_request_limits({scope: {"concurrency": 1}})  # fmt: skip
    slow = {**CHAT, "max_tokens": 50, "ignore_eos": True, "stream": True}

    with http.stream(
        "POST", gateway.url + "/v1/chat/completions", json=slow, headers=bearer(world.acme)
    ) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # admitted, streaming
        assert world.rds.zcard(in_flight_key(scope)) == 1
        second = http.post(
            gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
        )
        rest = [line for line in lines if line.startswith("data:")]

    assert rest[-1] == "data: [DONE]"  # the first ran to its end, unhurt by the refusal
    assert second.status_code == 429, second.text
    error = second.json()["error"]
    assert (error["code"], error["limit"], error["limit_scope"]) == (
        "concurrency_limit_exceeded",
        "concurrency",
        "customer",
    )
    assert "over your limit of requests in flight" in error["message"]
    assert int(second.headers["Retry-After"]) >= 1
    # The gateway's end of the first request frees its slot: the next one is admitted.
    wait_for(lambda: world.rds.zcard(in_flight_key(scope)) == 0)
    third = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme))
    assert third.status_code == 200, third.text
    events = wait_for(lambda: len(usage_events(usage_server)) == 3 and usage_events(usage_server))
    assert sorted(e["outcome"] for e in events) == ["completed", "completed", "refused"]


def test_a_keys_tokens_per_minute_count_input_and_max_tokens_and_a_429_names_the_limit(
    served, http, usage_server
):
    world, gateway, _url = served
    scope = api_key_scope(world.acme.prefix)
    Buckets(world.rds, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600)\
        .publish_request_limits({scope: {"tpm": 1000}})  # fmt: skip
    # A short prompt and at most 400 tokens out: about 410 tokens each, two fit in 1,000.
    asked = {**CHAT, "max_tokens": 400}
    answers = [
        http.post(gateway.url + "/v1/chat/completions", json=asked, headers=bearer(world.acme))
        for _ in range(3)
    ]

    assert [a.status_code for a in answers] == [200, 200, 429], [a.text for a in answers]
    error = answers[2].json()["error"]
    assert (error["code"], error["limit"], error["limit_scope"]) == (
        "tpm_limit_exceeded",
        "tpm",
        "api_key",
    )
    assert "this API key's limit of tokens per minute" in error["message"]
    # The two admitted leave the window a minute after they came.
    assert 50 <= int(answers[2].headers["Retry-After"]) <= 60
    # A request larger than the whole limit never fits, and says so.
    huge = http.post(
        gateway.url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": 1500},
        headers=bearer(world.acme),
    )
    assert huge.status_code == 429
    assert huge.json()["error"]["limit"] == "tpm"
    assert "never fits" in huge.json()["error"]["message"]
    events = wait_for(lambda: len(usage_events(usage_server)) == 4 and usage_events(usage_server))
    assert [e["outcome"] for e in events].count("refused") == 2


def test_a_customer_past_its_budgets_hard_cap_gets_budget_exceeded_for_best_effort(
    served, http, usage_server
):
    world, gateway, _url = served
    set_limits(world.rds, {(1, 7): (0.0, 1000.0)})  # no reservation: best-effort only
    Buckets(world.rds, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600)\
        .publish_request_limits({customer_scope(1): {"budget": 1}})  # fmt: skip

    response = http.post(
        gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
    )

    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["code"], error["limit"]) == ("budget_exceeded", "budget")
    assert "budget" in error["message"]
    events = wait_for(lambda: usage_events(usage_server))
    assert [e["outcome"] for e in events] == ["refused"]


def test_a_key_past_its_budgets_hard_cap_gets_budget_exceeded_and_another_key_is_admitted(
    served, http, usage_server
):
    world, gateway, _url = served
    other = C.key(customer_id=1, customer="acme")
    world.publication.keys[other.prefix] = other.doc
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)
    set_limits(world.rds, {(1, 7): (0.0, 1000.0)})  # no reservation: best-effort only
    # The hard cap of the budget of acme's first key (adm:rl:k:<prefix> field `budget`).
    Buckets(world.rds, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600)\
        .publish_request_limits({api_key_scope(world.acme.prefix): {"budget": 1}})  # fmt: skip

    capped = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme))
    admitted = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(other))

    assert capped.status_code == 429, capped.text
    error = capped.json()["error"]
    assert (error["code"], error["limit"], error["limit_scope"]) == (
        "budget_exceeded",
        "budget",
        "api_key",
    )
    assert "this API key's monthly budget" in error["message"]
    assert admitted.status_code == 200, admitted.text
    events = wait_for(lambda: len(usage_events(usage_server)) == 2 and usage_events(usage_server))
    # Each event names the key it came with, for the control plane to check against its record.
    assert sorted((e["api_key"], e["outcome"]) for e in events) == sorted(
        [(world.acme.prefix, "refused"), (other.prefix, "completed")]
    )


def test_best_effort_is_refused_while_the_model_is_degraded(served, http, usage_server):
    world, gateway, url = served
    set_limits(world.rds, {(1, 7): (0.0, 1000.0)})  # no reservation: best-effort only
    world.publication.models["tiny"] = C.model(7, [C.replica(url)], refuse_best_effort=True)
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    response = http.post(
        gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
    )

    assert response.status_code == 429


def test_while_only_the_free_tier_is_shed_its_best_effort_is_refused_and_a_paid_ones_admitted(
    served, http, usage_server
):
    world, gateway, url = served
    globex = C.key(customer_id=2, customer="globex")
    world.publication.keys[globex.prefix] = globex.doc
    world.publication.entitlements[2] = ["tiny"]
    world.publication.customer_tiers = {1: "free", 2: "premium"}
    # Neither has a reservation: every request of both is best-effort.
    set_limits(world.rds, {(1, 7): (0.0, 1000.0), (2, 7): (0.0, 1000.0)})
    world.publication.models["tiny"] = C.model(
        7, [C.replica(url)], level=1, refuse_best_effort=True, shed_tiers=["free"]
    )
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    free = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme))
    paid = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(globex))

    assert free.status_code == 429, free.text
    assert paid.status_code == 200, paid.text
    events = wait_for(lambda: len(usage_events(usage_server)) == 2 and usage_events(usage_server))
    outcomes = {e["customer"]: (e["outcome"], e.get("admission_class")) for e in events}
    assert outcomes == {"acme": ("refused", None), "globex": ("completed", "best_effort")}

    # A customer the publication gives no tier is shed with the listed ones (the safe side).
    del world.publication.customer_tiers[2]
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)
    unknown = http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(globex))
    assert unknown.status_code == 429, unknown.text


def test_the_degradation_caps_max_tokens(served, http):
    world, gateway, url = served
    world.publication.models["tiny"] = C.model(7, [C.replica(url)], max_tokens_cap=3)
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    response = http.post(
        gateway.url + "/v1/completions",
        json={"model": "tiny", "prompt": "a b", "max_tokens": 50, "ignore_eos": True},
        headers=bearer(world.acme),
    )

    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_a_refused_request_falls_back_to_the_degraded_models_fallback(served, http, usage_server):
    world, gateway, url = served
    set_limits(world.rds, {(1, 7): (0.0, 0.0), (1, 8): (1000.0, 0.0)})
    world.publication.models["tiny"] = C.model(7, [C.replica(url)], fallback_model="small")
    world.publication.models["small"] = C.model(8, [C.replica(url, deployment="small-a")])
    world.publication.entitlements[1] = ["tiny", "small"]
    version = world.publish()
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)

    response = http.post(
        gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
    )

    assert response.status_code == 200
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert (event["model"], event["outcome"]) == ("small", "completed")


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model",
        ),
        (json.dumps({**CHAT, "max_tokens": -1}), 400, "max_tokens"),
        (json.dumps({**CHAT, "max_tokens": "12"}), 400, "max_tokens"),
        (json.dumps({"model": "tiny"}), 400, "messages"),
        (json.dumps([1, 2]), 400, None),
        # Issue 34, finding 11: each was a 500 (and the worker's traceback).
        (b"[" * 100_000 + b"]" * 100_000, 400, None),
        (
            json.dumps({**CHAT, "messages": [{"role": "user", "content": [[[]]]}]}).replace(
                "[[[]]]", "[" * 990 + "]" * 990
            ),
            400,
            None,  # too deep for the parser: the body as a whole
        ),
        (
            json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}),
            400,
            "messages[0].content",
        ),
        (b'{"model": "tiny\ud800", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
    ids=[
        "malformed",
        "unknown-model",
        "negative-max-tokens",
        "string-max-tokens",
        "no-messages",
        "not-an-object",
        "nested-100k-deep",
        "content-nested-990-lists",
        "lone-surrogate-in-content",
        "lone-surrogate-in-model",
    ],
)
def test_bad_input_gets_an_openai_shaped_4xx(served, http, body, status, param):
    world, gateway, _url = served
    response = http.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers={**bearer(world.acme), "Content-Type": "application/json"},
    )

    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


def test_a_20_mb_body_gets_a_413(served, http):
    world, gateway, _url = served
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (20 * 1024 * 1024)}]})
    response = http.post(
        gateway.url + "/v1/chat/completions",
        content=big,
        headers={**bearer(world.acme), "Content-Type": "application/json"},
    )

    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_unknown_paths_and_methods_answer_in_openais_shape(served, http):
    _world, gateway, _url = served
    missing = http.get(gateway.url + "/v1/nothing")
    wrong_method = http.get(gateway.url + "/v1/chat/completions")
    assert missing.status_code == 404 and "error" in missing.json()
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_metrics_count_requests_by_outcome_and_class(served, http):
    world, gateway, _url = served
    http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme))
    completed = 'gateway_requests_total{admission_class="guaranteed",outcome="completed"} 1.0'

    # Counted once the answer is out: the metrics may be asked for first.
    def metrics_with_it() -> str:
        page = http.get(gateway.url + "/metrics").text
        return page if completed in page else ""

    text = wait_for(metrics_with_it)
    assert "gateway_overhead_seconds_bucket" in text
    assert "gateway_time_to_first_token_seconds_bucket" in text


def test_two_workers_share_the_port_and_metrics_sum_them(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator()
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    gateway = start_gateway(GATEWAY_WORKERS="2")
    assert "(2 workers)" in gateway.log()

    for _ in range(6):
        with httpx.Client(trust_env=False) as fresh:  # new connections, spread by the kernel
            response = fresh.post(
                gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
            )
            assert response.status_code == 200

    # A request is counted once its answer is out (the client may ask for the metrics first).
    completed = 'gateway_requests_total{admission_class="guaranteed",outcome="completed"} 6.0'
    assert wait_for(lambda: completed in http.get(gateway.url + "/metrics").text)
    assert (
        len(wait_for(lambda: len(usage_events(usage_server)) == 6 and usage_events(usage_server)))
        == 6
    )


def _children(pid: int) -> set[int]:
    """The gateway's worker processes (its children started by multiprocessing's spawn), from
    /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"spawn_main" in command:
                found.add(int(entry.name))
    return found


def test_a_gateway_worker_that_dies_is_started_again_while_the_other_serves(
    world, start_emulator, start_gateway, http
):
    url, _ = start_emulator()
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    gateway = start_gateway(GATEWAY_WORKERS="2")
    # Both listening: killed while the other was still starting, the port had no listener.
    wait_for_workers(world.rds, 2)
    workers = wait_for(lambda: len(found := _children(gateway.process.pid)) == 2 and found)
    dead = max(workers)
    os.kill(dead, signal.SIGKILL)
    statuses = []
    for _ in range(10):
        with httpx.Client(trust_env=False) as fresh:  # new connections: either worker
            statuses.append(
                fresh.post(
                    gateway.url + "/v1/chat/completions", json=CHAT, headers=bearer(world.acme)
                ).status_code
            )
    replaced = wait_for(
        lambda: len(found := _children(gateway.process.pid) - {dead}) >= 2 and found
    )
    assert dead not in replaced and gateway.process.poll() is None
    assert "exited (-9)" in gateway.log()
    assert statuses.count(200) >= 9, statuses  # one may have met the dying worker's backlog


@pytest.fixture
def private_redis(tmp_path) -> Iterator[redis.Redis]:
    """A Redis server of the test's own: pausing it pauses nobody else's tests."""
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        wait_for(lambda: _answers(client))
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_a_client_that_leaves_while_redis_decides_still_leaves_its_event(
    private_redis, start_emulator, start_gateway, http, usage_server
):
    """Admission is awaited (redis.asyncio): a client can leave meanwhile. The decision stands
    (Redis records it), so the request's one usage event is still left: cancelled, with its
    class."""
    url, _ = start_emulator()
    acme = C.key(customer_id=1, customer="acme")
    C.publish(
        private_redis,
        C.Publication(
            keys={acme.prefix: acme.doc},
            models={"tiny": C.model(7, [C.replica(url, deployment="tiny-a")])},
            entitlements={1: ["tiny"]},
        ),
    )
    set_limits(private_redis, {(1, 7): (1000.0, 1000.0)})
    port = private_redis.connection_pool.connection_kwargs["port"]
    gateway = start_gateway(
        GATEWAY_REDIS_URL=f"redis://127.0.0.1:{port}/0", GATEWAY_REDIS_TIMEOUT_SECONDS="5"
    )
    body = {**CHAT, "max_tokens": 4}
    assert http.post(
        gateway.url + "/v1/chat/completions", json=body, headers=bearer(acme)
    ).is_success

    private_redis.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # scripts wait
    with pytest.raises(httpx.ReadTimeout):
        http.post(
            gateway.url + "/v1/chat/completions", json=body, headers=bearer(acme), timeout=0.3
        )

    events = wait_for(lambda: len(usage_events(usage_server)) == 2 and usage_events(usage_server))
    left = events[1]
    assert left["outcome"] == "cancelled"
    assert left["admission_class"] == "guaranteed"
    assert left["output_tokens"] == 0
    record = private_redis.get(f"adm:req:7:1:{left['event_id']}")
    assert record is not None and record.startswith(b"guaranteed:")
    assert emulator_counter(http, url, "vllm:request_success_total") == 1  # never sent on


def test_a_chat_request_with_two_images_leaves_an_event_with_images_2_and_the_cached_tokens(
    world, start_emulator, start_gateway, http, usage_server
):
    # The engine reports its prefix-cache hits (vLLM's --enable-prompt-tokens-details).
    url, _process = start_emulator(args=("--enable-prompt-tokens-details",))
    world.publication.models["tiny"] = C.model(7, [C.replica(url, deployment="tiny-a")])
    world.publish()
    gateway = start_gateway()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    text = {"type": "text", "text": "compare these two pictures"}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [text, image, dict(image)]}],
        "max_tokens": 4,
    }

    for _ in range(2):  # the second is served from the engine's prefix cache
        response = http.post(
            gateway.url + "/v1/chat/completions", json=body, headers=bearer(world.acme)
        )
        assert response.status_code == 200, response.text

    events = wait_for(lambda: len(usage_events(usage_server)) == 2 and usage_events(usage_server))
    assert [event["images"] for event in events] == [2, 2]
    # The engine's own count: 4 words and 576 tokens per image (the emulator's default).
    assert {event["input_tokens"] for event in events} == {4 + 2 * 576}
    cached = sorted(event["cached_input_tokens"] for event in events)
    assert cached[0] == 0 and cached[1] > 0 and cached[1] % 16 == 0
