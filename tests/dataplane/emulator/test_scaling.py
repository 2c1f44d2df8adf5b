"""The scale endpoint: cold starts, draining, and requests for a model with no ready replica."""

import time

from .support import (
    config,
    metric,
    model,
    scrape,
    start_streams,
    stream,
    wait_for_samples,
    wait_until,
)


def _replicas(http, emulator, name="tiny"):
    models = http.get(f"{emulator.url}/admin/replicas").json()["models"]
    return next(m for m in models if m["model"] == name)


def _scale(http, emulator, replicas, name="tiny"):
    return http.post(f"{emulator.url}/admin/replicas", json={"model": name, "replicas": replicas})


def test_a_new_replica_serves_only_after_its_cold_start(start_emulator, http):
    emulator = start_emulator(config(model(replicas=0, cold_start_seconds=0.3)))

    scaled_at = time.perf_counter()
    response = _scale(http, emulator, 1)
    assert response.status_code == 200
    assert (response.json()["ready"], response.json()["starting"]) == (0, 1)
    pending = start_streams(
        emulator.url, [{"model": "tiny", "prompt": [1], "max_tokens": 2, "ignore_eos": True}]
    )
    samples = wait_for_samples(
        http,
        emulator.url,
        lambda s: metric(s, "vllm:num_requests_waiting", model_name="tiny") == 1,
    )
    assert metric(samples, "emulator_replicas", model_name="tiny", state="starting") == 1

    (result,) = pending.result(timeout=5)
    assert result.token_seconds[0] - scaled_at >= 0.3
    assert _replicas(http, emulator)["ready"] == 1


def test_scaling_up_a_serving_model_adds_a_starting_replica_then_a_ready_one(start_emulator, http):
    emulator = start_emulator(config(model(replicas=1, cold_start_seconds=0.2)))

    status = _scale(http, emulator, 2).json()

    assert (status["ready"], status["starting"], status["target"]) == (1, 1, 2)
    wait_until(lambda: _replicas(http, emulator)["ready"] == 2)
    assert _replicas(http, emulator)["starting"] == 0


def test_scaling_down_drains_in_flight_requests_before_the_replica_goes(start_emulator, http):
    emulator = start_emulator(config(model(replicas=1, decode_step_base_seconds=0.005)))
    in_flight = start_streams(
        emulator.url, [{"model": "tiny", "prompt": [1], "max_tokens": 40, "ignore_eos": True}]
    )
    wait_until(lambda: _replicas(http, emulator)["running"] == 1)

    status = _scale(http, emulator, 0).json()

    assert (status["ready"], status["draining"]) == (0, 1)
    (result,) = in_flight.result(timeout=5)
    assert len(result.token_events) == 40
    assert result.token_events[-1]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: _replicas(http, emulator)["draining"] == 0)


def test_a_request_for_a_model_without_replicas_times_out_with_503(start_emulator, http):
    emulator = start_emulator(config(model(replicas=0, pending_timeout_seconds=0.1)))

    streamed = stream(http, f"{emulator.url}/v1/completions", {"model": "tiny", "prompt": "hi"})
    unary = http.post(f"{emulator.url}/v1/completions", json={"model": "tiny", "prompt": "hi"})

    assert streamed.status == 503
    assert unary.status_code == 503
    assert "No ready replica" in unary.json()["error"]["message"]
    assert metric(scrape(http, emulator.url), "vllm:num_requests_waiting", model_name="tiny") == 0


def test_scale_requests_are_validated(start_emulator, http):
    emulator = start_emulator(config(model()))
    url = f"{emulator.url}/admin/replicas"

    assert http.post(url, json={"model": "nope", "replicas": 1}).status_code == 404
    bad = http.post(url, json={"model": "tiny", "replicas": -1})
    assert bad.status_code == 400
    assert "replicas" in bad.json()["error"]["message"]
    assert http.post(url, json={"model": "tiny", "replicas": "2"}).status_code == 400
    assert http.post(url, json={"replicas": 2}).json()["error"]["param"] == "model"


def test_scaling_down_cancels_starting_replicas_before_draining_ready_ones(start_emulator, http):
    emulator = start_emulator(config(model(replicas=1, cold_start_seconds=5)))
    _scale(http, emulator, 3)

    status = _scale(http, emulator, 1).json()

    assert (status["ready"], status["starting"], status["draining"]) == (1, 0, 0)
