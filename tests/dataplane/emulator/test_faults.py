"""Deterministic output and injected faults, against emulator processes over real HTTP."""

import time

import httpx
import pytest

from dataplane.emulator.config import ConfigError
from dataplane.emulator.faults import FaultError, FaultSpec, parse_fault_flag
from tests.support.processes import emulator_process, emulator_subprocess

from .support import config, metric, model, scrape, wait_until

# Measures real throughput and latency: runs alone, not beside another test worker.
pytestmark = pytest.mark.serial

# What an inference probe sends: a fixed prompt, greedy, a fixed length.
PROBE = {
    "model": "tiny",
    "prompt": "The capital of France is",
    "max_tokens": 8,
    "temperature": 0,
}
# 10 ms decode steps: an 8-token probe takes ~80 ms.
TINY = model(decode_step_base_seconds=0.01)


def _config(seed: int = 0, **overrides) -> dict:
    return {"seed": seed, "models": [{**TINY, **overrides}]}


def _complete(client: httpx.Client, base_url: str, body: dict = PROBE, **kwargs) -> str:
    response = client.post(f"{base_url}/v1/completions", json=body, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _fault(client: httpx.Client, base_url: str, **body) -> dict:
    response = client.post(f"{base_url}/emulator/faults", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_output_is_the_same_on_every_call_and_process_and_depends_on_the_prompt(
    tmp_path, http
):
    # Different config seeds: greedy output is a function of the model and the prompt only.
    with (
        emulator_process(_config(seed=1), tmp_path) as first,
        emulator_process(_config(seed=2), tmp_path) as second,
    ):
        known_good = _complete(http, first, PROBE)
        # Other traffic in between changes nothing.
        _complete(http, first, {"model": "tiny", "prompt": "something else", "max_tokens": 30})
        assert _complete(http, first, PROBE) == known_good
        assert _complete(http, second, PROBE) == known_good
        assert _complete(http, second, {**PROBE, "seed": 99}) == known_good  # seed is moot
        assert known_good.strip()

        other_prompt = _complete(http, first, {**PROBE, "prompt": "The capital of Italy is"})
        assert other_prompt != known_good

        # The same holds for chat, and for sampling with a request seed.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        chat |= {"max_tokens": 8, "temperature": 0}
        answers = [
            http.post(f"{url}/v1/chat/completions", json=chat).json()["choices"][0]["message"]
            for url in (first, second)
        ]
        assert answers[0] == answers[1]
        seeded = {**PROBE, "temperature": 0.8, "seed": 7}
        assert _complete(http, first, seeded) == _complete(http, second, seeded)
        assert _complete(http, first, seeded) != _complete(http, first, {**seeded, "seed": 8})


def test_a_hang_leaves_health_and_metrics_answering_but_no_inference_until_cleared(tmp_path, http):
    with emulator_process(_config(), tmp_path) as url:
        known_good = _complete(http, url)

        state = _fault(http, url, mode="hang")
        assert state["mode"] == "hang"

        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json=PROBE, timeout=2.0)
        assert http.get(f"{url}/health", timeout=1.0).status_code == 200
        assert http.get(f"{url}/v1/models", timeout=1.0).status_code == 200
        samples = scrape(http, url)
        assert metric(samples, "emulator_fault_active", mode="hang") == 1
        assert metric(samples, "emulator_fault_active", mode="slow") == 0

        assert _fault(http, url, mode="none")["mode"] == "none"
        assert _complete(http, url, timeout=2.0) == known_good
        assert metric(scrape(http, url), "emulator_fault_active", mode="hang") == 0


def test_a_hang_with_a_duration_ends_by_itself(tmp_path, http):
    with emulator_process(_config(), tmp_path) as url:
        state = _fault(http, url, mode="hang", duration_seconds=1.0)
        assert state["mode"] == "hang"
        assert 0 < state["ends_in_seconds"] <= 1.0

        started = time.perf_counter()
        _complete(http, url, timeout=5.0)  # held until the hang ends, then answered
        assert 0.5 < time.perf_counter() - started < 3.0
        assert http.get(f"{url}/emulator/faults").json()["mode"] == "none"


def _latency(http, url, body) -> float:
    started = time.perf_counter()
    _complete(http, url, body)
    return time.perf_counter() - started


def test_slow_multiplies_the_step_time_by_its_factor(tmp_path, http):
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 30, "ignore_eos": True}
    with emulator_process(_config(), tmp_path) as url:
        normal = min(_latency(http, url, body) for _ in range(2))  # ~0.3 s

        state = _fault(http, url, mode="slow", factor=3)
        assert (state["mode"], state["factor"]) == ("slow", 3.0)
        slow = min(_latency(http, url, body) for _ in range(2))  # ~0.9 s
        assert metric(scrape(http, url), "emulator_fault_active", mode="slow") == 1

    assert 2.3 < slow / normal < 3.7, (normal, slow)


def test_wrong_output_answers_as_fast_with_different_text(tmp_path, http):
    with emulator_process(_config(), tmp_path) as url:
        known_good = _complete(http, url)
        normal = _latency(http, url, PROBE)

        _fault(http, url, mode="wrong_output")
        started = time.perf_counter()
        wrong = _complete(http, url)
        elapsed = time.perf_counter() - started

        assert wrong != known_good
        assert len(wrong.split()) == len(known_good.split())
        assert elapsed < normal + 0.5
        assert metric(scrape(http, url), "emulator_fault_active", mode="wrong_output") == 1

        _fault(http, url, mode="none")
        assert _complete(http, url) == known_good


def test_a_crash_command_is_answered_then_the_process_exits_non_zero(tmp_path, http):
    with emulator_subprocess(_config(), tmp_path) as (url, process):
        state = _fault(http, url, mode="crash")
        assert state["scheduled"][0]["mode"] == "crash"

        assert process.wait(timeout=10) == 1
        with pytest.raises(httpx.TransportError):
            http.get(f"{url}/health", timeout=1.0)


def test_a_fault_scheduled_on_the_command_line_starts_on_time(tmp_path, http):
    with emulator_process(_config(), tmp_path, args=("--fault", "hang@2")) as url:
        state = http.get(f"{url}/emulator/faults").json()
        assert state["mode"] == "none"
        ((scheduled),) = state["scheduled"]
        assert scheduled["mode"] == "hang"
        assert 0 < scheduled["starts_in_seconds"] <= 2
        # Before its time the replica serves.
        _complete(http, url, timeout=2.0)

        wait_until(
            lambda: http.get(f"{url}/emulator/faults").json()["mode"] == "hang",
            timeout_seconds=4,
            interval_seconds=0.05,
        )
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json=PROBE, timeout=1.0)


def test_a_crash_scheduled_in_the_config_ends_the_process(tmp_path, http):
    spec = {**_config(), "faults": [{"mode": "crash", "at_seconds": 1.5}]}
    with emulator_subprocess(spec, tmp_path) as (url, process):
        _complete(http, url, timeout=2.0)
        assert process.poll() is None
        assert process.wait(timeout=10) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"mode": "explode"}, "mode"),
        ({}, "mode"),
        ({"mode": "slow"}, "factor"),
        ({"mode": "slow", "factor": 0.5}, "factor"),
        ({"mode": "slow", "factor": "3"}, "factor"),
        ({"mode": "hang", "factor": 2}, "factor"),
        ({"mode": "hang", "after_seconds": -1}, "after_seconds"),
        ({"mode": "hang", "duration_seconds": 0}, "duration_seconds"),
        ({"mode": "crash", "duration_seconds": 5}, "duration_seconds"),
        ({"mode": "none", "after_seconds": 3}, "after_seconds"),
        ({"mode": "hang", "at_seconds": 3}, "at_seconds"),
        (["hang"], "fault"),
    ],
)
def test_bad_fault_commands_are_400s_that_name_the_field(start_emulator, http, body, param):
    emulator = start_emulator(config(model()))
    response = http.post(f"{emulator.url}/emulator/faults", json=body)

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]
    assert http.get(f"{emulator.url}/emulator/faults").json()["mode"] == "none"


def test_the_fault_flag_syntax():
    assert parse_fault_flag("hang@30") == FaultSpec("hang", at_seconds=30)
    assert parse_fault_flag("slow:3@10+20") == FaultSpec(
        "slow", at_seconds=10, duration_seconds=20, factor=3
    )
    assert parse_fault_flag("wrong_output") == FaultSpec("wrong_output")
    assert parse_fault_flag("crash@4.5") == FaultSpec("crash", at_seconds=4.5)
    for bad, named in [("slow@3", "factor"), ("hang@soon", "start"), ("melt@1", "mode")]:
        with pytest.raises(FaultError, match=named):
            parse_fault_flag(bad)


@pytest.mark.parametrize(
    ("faults", "named"),
    [
        ({"mode": "hang"}, "faults"),
        ([{"mode": "hang", "at_seconds": -1}], r"faults\[0\].at_seconds"),
        ([{"mode": "none"}], r"faults\[0\].mode"),
        ([{"mode": "slow", "at_seconds": 1}], r"faults\[0\].factor"),
    ],
)
def test_a_bad_fault_schedule_in_the_config_is_refused_naming_the_field(faults, named):
    from dataplane.emulator import parse_config

    with pytest.raises(ConfigError, match=named):
        parse_config({"models": [{"name": "m"}], "faults": faults})
