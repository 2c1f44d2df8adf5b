"""Streams through the gateway: SSE passed through with the engine's own usage, a client that
leaves cancels the engine's request, the per-token timeout, and retries only before the first
byte."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.support.processes import ROOT, emulator_command, free_port

from . import contract as C
from .conftest import bearer, tiny_model, usage_events, wait_for

SLOW = {"seed": 0, "models": [tiny_model(decode_step_base_seconds=0.02)]}
LONG = {"model": "tiny", "prompt": "a b c d", "max_tokens": 1000, "ignore_eos": True}


def gauge(http: httpx.Client, url: str, name: str) -> float:
    total = 0.0
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sse(lines) -> tuple[list[dict], bool]:
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[6:]))
    return events, done


def publish_replicas(world, urls: list[str], **model_options) -> int:
    world.publication.models["tiny"] = C.model(
        7, [C.replica(u, deployment=f"tiny-{i}") for i, u in enumerate(urls)], **model_options
    )
    return world.publish()


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_passes_through_with_the_engines_token_counts(
    world, start_emulator, start_gateway, http, usage_server, include_usage
):
    url, _ = start_emulator()
    publish_replicas(world, [url])
    gateway = start_gateway()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi you"}], "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}

    with http.stream(
        "POST", gateway.url + "/v1/chat/completions", json=body, headers=bearer(world.acme)
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events, done = sse(response.iter_lines())

    assert done
    usage_chunks = [e for e in events if e.get("usage")]
    event = wait_for(lambda: usage_events(usage_server))[0]
    engine_tokens = gauge(http, url, "vllm:generation_tokens_total")
    assert event["outcome"] == "completed"
    assert event["output_tokens"] == engine_tokens > 0
    assert event["input_tokens"] == 2
    assert event["ttft_ms"] > 0
    if include_usage:
        assert usage_chunks[-1]["usage"]["completion_tokens"] == engine_tokens
    else:
        # The client did not ask: the usage-only chunk the gateway forced is not passed on.
        assert not usage_chunks and all(e["choices"] for e in events)


def test_a_client_that_leaves_cancels_the_engines_request_within_a_second(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator(SLOW)
    publish_replicas(world, [url])
    gateway = start_gateway()

    with http.stream(
        "POST",
        gateway.url + "/v1/completions",
        json={**LONG, "stream": True},
        headers=bearer(world.acme),
    ) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen >= 5:
                break
        assert gauge(http, url, "vllm:num_requests_running") == 1
    left_at = time.monotonic()

    wait_for(lambda: gauge(http, url, "vllm:num_requests_running") == 0, timeout_seconds=1.0)
    assert time.monotonic() - left_at < 1.0
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert event["outcome"] == "cancelled"
    assert 5 <= event["output_tokens"] <= gauge(http, url, "vllm:generation_tokens_total")


def test_a_non_streamed_client_that_leaves_cancels_too(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator(SLOW)
    publish_replicas(world, [url])
    gateway = start_gateway()

    with pytest.raises(httpx.ReadTimeout):
        http.post(
            gateway.url + "/v1/completions", json=LONG, headers=bearer(world.acme), timeout=0.5
        )

    wait_for(lambda: gauge(http, url, "vllm:num_requests_running") == 0, timeout_seconds=1.0)
    assert wait_for(lambda: usage_events(usage_server))[0]["outcome"] == "cancelled"


def test_the_per_token_timeout_ends_a_stream_that_stalls_with_an_error_event(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator(SLOW)
    publish_replicas(world, [url])
    gateway = start_gateway(GATEWAY_TOKEN_TIMEOUT_SECONDS="0.5")

    started = time.monotonic()
    with http.stream(
        "POST",
        gateway.url + "/v1/completions",
        json={**LONG, "stream": True},
        headers=bearer(world.acme),
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                # Each engine step now takes 200 x 20 ms = 4 s.
                http.post(url + "/emulator/faults", json={"mode": "slow", "factor": 200})
                break
        events, done = sse(lines)

    assert time.monotonic() - started < 4
    assert "no token within 0.5 s" in events[-1]["error"]["message"]
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert event["outcome"] == "error"
    assert event["output_tokens"] >= 1


def test_a_replica_dead_before_the_first_byte_is_retried_on_another(
    world, start_emulator, start_gateway, http, usage_server
):
    dead_url, dead = start_emulator()
    live_url, _ = start_emulator()
    publish_replicas(world, [dead_url, live_url])
    dead.kill()
    dead.wait()
    gateway = start_gateway()

    for stream in (False, True, False, True):
        response = http.post(
            gateway.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": stream},
            headers=bearer(world.acme),
        )
        assert response.status_code == 200, response.text

    assert "gateway_retries_total 0.0" not in http.get(gateway.url + "/metrics").text
    events = wait_for(lambda: len(usage_events(usage_server)) == 4 and usage_events(usage_server))
    assert {e["outcome"] for e in events} == {"completed"}
    assert {e["deployment"] for e in events} == {"tiny-1"}


def test_a_published_replica_not_listening_yet_holds_the_request_until_it_listens(
    world, start_gateway, http, usage_server, tmp_path
):
    # A second `make run`: the contract still names the replicas of the last run, on the ports
    # the new supervisor starts them on a few seconds later. Nothing listens there yet, so no
    # request reached an engine: the gateway holds it (as for a model at zero) rather than
    # answering 502, and serves it once the replica listens.
    port = free_port()
    publish_replicas(world, [f"http://127.0.0.1:{port}"])
    gateway = start_gateway()
    result = {}

    def send():
        result["response"] = http.post(
            gateway.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 4},
            headers=bearer(world.acme),
        )

    sender = threading.Thread(target=send)
    sender.start()
    wait_for(lambda: gauge(http, gateway.url, "gateway_retries_total") >= 2)  # tried, refused
    assert sender.is_alive()  # held, not answered
    config = tmp_path / "late-replica.json"
    config.write_text(json.dumps({"seed": 0, "models": [tiny_model()]}))
    late = subprocess.Popen(emulator_command(config, port), cwd=ROOT)
    try:
        sender.join(timeout=20)
        assert result["response"].status_code == 200, result["response"].text
    finally:
        late.terminate()
        late.wait(timeout=10)
    (event,) = wait_for(lambda: usage_events(usage_server))
    assert (event["outcome"], event["deployment"]) == ("completed", "tiny-0")


def test_replicas_that_never_listen_are_a_502_after_the_cold_start_wait(
    world, start_gateway, http, usage_server
):
    publish_replicas(world, [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"])
    gateway = start_gateway(GATEWAY_COLD_START_WAIT_SECONDS="1.5")

    started = time.monotonic()
    response = http.post(
        gateway.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 4},
        headers=bearer(world.acme),
    )

    assert 1.0 <= time.monotonic() - started < 10
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream"
    assert "Connection refused" in response.json()["error"]["message"]
    (event,) = wait_for(lambda: usage_events(usage_server))
    assert event["outcome"] == "error" and event["output_tokens"] == 0


def test_a_replica_that_dies_after_the_first_byte_ends_the_stream_with_an_error_and_no_retry(
    world, start_emulator, start_gateway, http, usage_server
):
    a = start_emulator(SLOW)
    b = start_emulator(SLOW)
    publish_replicas(world, [a[0], b[0]])
    gateway = start_gateway()

    with http.stream(
        "POST",
        gateway.url + "/v1/completions",
        json={**LONG, "stream": True},
        headers=bearer(world.acme),
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        serving, other = (a, b) if gauge(http, a[0], "vllm:num_requests_running") else (b, a)
        serving[1].kill()
        events, _done = sse(lines)

    assert "error" in events[-1]
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert event["outcome"] == "error"
    time.sleep(0.3)
    assert gauge(http, other[0], "vllm:prompt_tokens_total") == 0  # never retried there


def test_a_client_that_closes_as_soon_as_it_reads_done_leaves_completed_events(
    world, start_emulator, start_gateway, http, usage_server
):
    """Many SSE clients stop reading at `data: [DONE]` and close the connection before the
    stream's last bytes (the chunked terminator): they got the whole answer, so the event is
    `completed`, never `cancelled`."""
    url, _ = start_emulator()
    publish_replicas(world, [url])
    gateway = start_gateway()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    requests = 30
    for _ in range(requests):
        with http.stream(
            "POST", gateway.url + "/v1/chat/completions", json=body, headers=bearer(world.acme)
        ) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    break  # leaving the block closes the connection, unread bytes and all

    events = wait_for(lambda: len(usage_events(usage_server)) == requests)
    events = usage_events(usage_server)
    assert {event["outcome"] for event in events} == {"completed"}


@pytest.fixture
def silent_replica():
    """A replica that accepts connections and never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for connection in accepted:
        connection.close()


def test_a_replica_silent_before_its_first_byte_is_given_up_after_the_token_timeout_and_retried(
    world, start_emulator, start_gateway, http, usage_server, silent_replica
):
    live_url, _ = start_emulator()
    publish_replicas(world, [silent_replica, live_url])
    gateway = start_gateway(GATEWAY_TOKEN_TIMEOUT_SECONDS="0.5")

    for _ in range(2):  # the first pick of the two goes in turn: one of these meets the silent one
        started = time.monotonic()
        response = http.post(
            gateway.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True},
            headers=bearer(world.acme),
        )
        assert response.status_code == 200, response.text
        assert time.monotonic() - started < 3
        assert "data: [DONE]" in response.text

    events = wait_for(lambda: len(usage_events(usage_server)) == 2 and usage_events(usage_server))
    assert {e["outcome"] for e in events} == {"completed"}
    assert {e["deployment"] for e in events} == {"tiny-1"}
    assert "gateway_retries_total 0.0" not in http.get(gateway.url + "/metrics").text


def test_a_stream_in_flight_finishes_when_the_gateway_is_told_to_stop(
    world, start_emulator, start_gateway, http, usage_server
):
    """A rollout's SIGTERM lets requests in flight end within GATEWAY_SHUTDOWN_GRACE_SECONDS
    (the pod's terminationGracePeriodSeconds is sized above it), rather than cutting them."""
    # 20 ms a token: 350 tokens take about 7 s, longer than the 5 s the gateway once gave.
    url, _ = start_emulator(SLOW)
    publish_replicas(world, [url])
    gateway = start_gateway(GATEWAY_SHUTDOWN_GRACE_SECONDS="12")
    body = {**LONG, "max_tokens": 350, "stream": True}

    with http.stream(
        "POST", gateway.url + "/v1/completions", json=body, headers=bearer(world.acme)
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                gateway.process.send_signal(signal.SIGTERM)
                break
        events, done = sse(lines)

    assert done, events[-1:]
    assert not [e for e in events if "error" in e]
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert (event["outcome"], event["output_tokens"]) == ("completed", 350)
    assert gateway.process.wait(timeout=10) == 0


def test_a_stream_longer_than_the_shutdown_grace_is_cut_and_recorded(
    world, start_emulator, start_gateway, http, usage_server
):
    url, _ = start_emulator(SLOW)
    publish_replicas(world, [url])
    gateway = start_gateway(GATEWAY_SHUTDOWN_GRACE_SECONDS="1")
    body = {**LONG, "max_tokens": 350, "stream": True}

    started = time.monotonic()
    with http.stream(
        "POST", gateway.url + "/v1/completions", json=body, headers=bearer(world.acme)
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                gateway.process.send_signal(signal.SIGTERM)
                break
        with pytest.raises(httpx.RemoteProtocolError):
            sse(lines)

    assert time.monotonic() - started < 5  # the grace and aiohttp's second, not 7 s
    event = wait_for(lambda: usage_events(usage_server))[0]
    assert event["outcome"] in ("cancelled", "error")
    assert 0 < event["output_tokens"] < 350
