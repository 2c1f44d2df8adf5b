"""The config loader, the ground-truth formula, and the two ways to start the emulator."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dataplane.emulator import (
    ConfigError,
    ground_truth_replica_seconds,
    load_config,
    parse_config,
    step_seconds,
)
from dataplane.emulator.__main__ import main as emulator_main
from dataplane.emulator.config import DEFAULT_MAX_NUM_SEQS, ModelConfig

DEMO_CONFIG = Path(__file__).resolve().parents[3] / "dataplane" / "emulator" / "demo.json"


def test_a_minimal_config_gets_the_documented_defaults():
    config = parse_config({"models": [{"name": "m"}]})

    (model,) = config.models
    assert config.seed == 0
    assert model.replicas == 1
    assert model.cold_start_seconds == 0
    assert model.max_num_seqs == DEFAULT_MAX_NUM_SEQS == 256
    assert model.kv_cache_tokens == 200_000
    assert model.context_length == 8192
    assert (model.scheduling_policy, model.priority_preemption) == ("fcfs", False)
    assert config.faults == ()


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ([], "config"),
        ({"models": []}, "models"),
        ({"models": [{"name": "m"}], "sed": 1}, "sed"),
        ({"seed": "1", "models": [{"name": "m"}]}, "seed"),
        ({"models": [{}]}, "models[0].name"),
        ({"models": [{"name": "m", "max_num_seqs": 0}]}, "models[0].max_num_seqs"),
        ({"models": [{"name": "m", "replicas": True}]}, "models[0].replicas"),
        ({"models": [{"name": "m", "prefill_seconds_per_token": -1}]}, "prefill_seconds_per_token"),
        ({"models": [{"name": "m", "decode_step_base_seconds": "fast"}]}, "decode_step_base"),
        ({"models": [{"name": "m", "kv_cache_tokens": 100}]}, "models[0].kv_cache_tokens"),
        ({"models": [{"name": "m", "max_num_seq": 4}]}, "models[0].max_num_seq"),
        ({"models": [{"name": "m"}, {"name": "m"}]}, "models[1].name"),
        ({"models": [{"name": "m", "scheduling_policy": "sjf"}]}, "models[0].scheduling_policy"),
        ({"models": [{"name": "m", "priority_preemption": True}]}, "priority_preemption"),
        (
            {"models": [{"name": "m", "scheduling_policy": "priority", "priority_preemption": 1}]},
            "models[0].priority_preemption",
        ),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(raw, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw)


def test_the_demo_config_loads_with_an_h100_like_8b_model():
    config = load_config(DEMO_CONFIG)

    big, tiny = config.models
    step = step_seconds(big, prefill_tokens=0, running_sequences=64, context_tokens=64 * 1500)
    assert 0.015 <= step <= 0.025
    assert tiny.decode_step_base_seconds < big.decode_step_base_seconds


def test_the_ground_truth_is_the_sum_of_the_engines_steps_at_a_steady_batch():
    model = ModelConfig(
        name="m",
        prefill_seconds_per_token=1e-4,
        decode_step_base_seconds=0.01,
        decode_seconds_per_sequence=1e-3,
        decode_seconds_per_context_token=1e-6,
    )
    input_tokens, output_tokens, batch = 500, 100, 8

    predicted = ground_truth_replica_seconds(model, input_tokens, output_tokens, batch)

    by_hand = 500 * 1e-4 + 100 * (0.01 / 8 + 1e-3) + 1e-6 * (500 * 100 + 100**2 / 2)
    assert predicted == pytest.approx(by_hand)
    # The request's share of each step: base/B, its own per-sequence cost, its own context.
    engine_share = model.prefill_seconds_per_token * input_tokens + sum(
        step_seconds(model, prefill_tokens=0, running_sequences=batch, context_tokens=0) / batch
        + model.decode_seconds_per_context_token * (input_tokens + k)
        for k in range(output_tokens)
    )
    assert engine_share == pytest.approx(predicted, rel=0.001)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_python_dash_m_serves_the_demo_config_without_django(tmp_path):
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dataplane.emulator", "--port", str(port), "--config",
         str(DEMO_CONFIG)],
        cwd=DEMO_CONFIG.parents[2],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(DEMO_CONFIG.parents[2])},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        with httpx.Client(trust_env=False, timeout=2) as http:
            while True:
                try:
                    models = http.get(f"http://127.0.0.1:{port}/v1/models").json()
                    break
                except httpx.TransportError:
                    assert process.poll() is None, process.stdout.read().decode()
                    assert time.monotonic() < deadline, "the emulator did not start"
                    time.sleep(0.05)
        assert [m["id"] for m in models["data"]] == ["llama-3.1-8b", "tiny-test"]
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert b"serving llama-3.1-8b, tiny-test" in process.stdout.read()


def test_while_it_loads_its_port_refuses_connections_then_it_serves(tmp_path):
    # As vLLM: the port is bound at once (no one else takes it), listened on once loaded.
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dataplane.emulator", "--port", str(port), "--config",
         str(DEMO_CONFIG), "--startup-seconds", "2"],
        cwd=DEMO_CONFIG.parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with httpx.Client(trust_env=False, timeout=1) as http:
            deadline = time.monotonic() + 10
            while b"loading" not in (process.stdout.peek() if process.stdout else b""):
                assert time.monotonic() < deadline, "the emulator printed nothing"
                time.sleep(0.05)
            loading_since = time.monotonic()
            with pytest.raises(httpx.ConnectError):
                http.get(f"http://127.0.0.1:{port}/health")
            with socket.socket() as taken, pytest.raises(OSError):
                taken.bind(("127.0.0.1", port))
            while True:
                try:
                    answer = http.get(f"http://127.0.0.1:{port}/health")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the emulator never served"
                    time.sleep(0.05)
        assert answer.status_code == 200
        assert time.monotonic() - loading_since >= 1.5
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_python_dash_m_refuses_a_bad_config_naming_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"models": [{"name": "m", "max_num_seqs": 0}]}))

    done = subprocess.run(
        [sys.executable, "-m", "dataplane.emulator", "--port", "1", "--config", str(bad)],
        cwd=DEMO_CONFIG.parents[2],
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert done.returncode == 2
    assert "models[0].max_num_seqs" in done.stderr


def test_the_entry_point_loads_the_config_and_runs_the_server(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "dataplane.emulator.__main__.run",
        lambda host, port, config, **options: calls.append((host, port, config, options)),
    )

    assert emulator_main(["--port", "9100", "--config", str(DEMO_CONFIG)]) == 0

    ((host, port, config, options),) = calls
    assert (host, port, options) == ("127.0.0.1", 9100, {"startup_seconds": 0.0})
    assert [m.name for m in config.models] == ["llama-3.1-8b", "tiny-test"]
