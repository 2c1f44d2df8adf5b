"""The fleet simulator: conservation, GPU-hours, throughput against the ground truth, latency of
a lone request, cold starts, admission, determinism and speed.

Pure Python on in-memory traces; no database.
"""

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest

from benchmarking import runner
from core import outbound
from dataplane.emulator.background import BackgroundEmulator
from dataplane.emulator.config import ModelConfig, parse_config
from simulation.engine import (
    REFUSED,
    SERVED,
    TIMED_OUT,
    ScheduledAutoscaler,
    SimulationSettings,
    StaticAutoscaler,
    TokenBucketAdmission,
    simulate,
)
from simulation.engine.profile import ground_truth_replica_seconds, step_seconds
from simulation.engine.traces import TraceRequest

MODEL = ModelConfig(name="m", max_num_seqs=32, kv_cache_tokens=200_000)


def poisson_trace(seed: int, rate_req_per_s: float, duration_s: float, clients=("default",)):
    rng = np.random.default_rng(seed)
    gaps_s = rng.exponential(1.0 / rate_req_per_s, int(rate_req_per_s * duration_s * 1.2) + 10)
    arrivals_s = np.cumsum(gaps_s)
    arrivals_s = arrivals_s[arrivals_s < duration_s]
    n = len(arrivals_s)
    inputs = rng.integers(100, 2000, n)
    outputs = rng.integers(10, 400, n)
    names = np.asarray(clients, dtype=object)[rng.integers(0, len(clients), n)]
    return list(map(TraceRequest, arrivals_s.tolist(), inputs.tolist(), outputs.tolist(), names))


def assert_every_request_resolved(result, n: int):
    assert len(result.outcome) == n
    assert set(np.unique(result.outcome)) <= {SERVED, REFUSED, TIMED_OUT}
    assert result.served + result.refused + result.timed_out == n
    served = result.outcome == SERVED
    assert not np.isnan(result.finish_s[served]).any()
    assert (result.first_token_s[served] >= result.start_s[served]).all()
    assert (result.start_s[served] >= result.arrival_s[served]).all()
    assert (result.finish_s[served] >= result.first_token_s[served]).all()


def test_every_request_ends_served_refused_or_timed_out():
    trace = poisson_trace(1, 20.0, 600.0, clients=("a", "b"))
    settings = SimulationSettings(
        model=MODEL,
        initial_replicas=2,
        queue_timeout_seconds=5.0,
        request_mu=lambda r: (r.input_tokens + r.output_tokens) / 1000,
        # "a" holds a reservation; "b" lives off a best-effort bucket too small for it.
        admission=TokenBucketAdmission(
            guaranteed_mu_per_minute={"a": 1000.0}, best_effort_mu_per_minute={"b": 100.0}
        ),
    )
    # Two replicas cannot carry 20 req/s: some wait past the timeout; then a scale-down drains.
    autoscaler = ScheduledAutoscaler([(0.0, 2), (300.0, 1)])
    result = simulate(trace, settings, autoscaler)

    assert_every_request_resolved(result, len(trace))
    assert result.refused > 0 and result.timed_out > 0 and result.served > 0
    clients = np.array([r.client for r in trace])
    assert not (result.outcome[clients == "a"] == REFUSED).any()
    timed_out = result.outcome == TIMED_OUT
    assert np.allclose(result.finish_s[timed_out], result.arrival_s[timed_out] + 5.0)
    assert np.isnan(result.start_s[timed_out]).all()
    assert result.scale_events == 1


def test_gpu_hours_of_a_static_fleet_are_replicas_times_gpus_times_duration():
    trace = poisson_trace(2, 2.0, 590.0)
    settings = SimulationSettings(
        model=MODEL, initial_replicas=3, gpus_per_replica=2, horizon_s=600.0
    )
    result = simulate(trace, settings, StaticAutoscaler(3))

    assert_every_request_resolved(result, len(trace))
    assert result.end_s == 600.0
    assert result.gpu_hours == pytest.approx(3 * 2 * 600.0 / 3600.0)


def test_gpu_hours_count_starting_replicas_and_stop_at_a_scale_down():
    settings = SimulationSettings(
        model=MODEL, initial_replicas=1, cold_start_seconds=40.0, horizon_s=450.0
    )
    # 1 replica; 2 more asked for at 150 s (ready at 190 s); back to 1 at 300 s (idle: removed).
    autoscaler = ScheduledAutoscaler([(0.0, 1), (150.0, 3), (300.0, 1)])
    result = simulate([TraceRequest(10.0, 100, 10)], settings, autoscaler)

    gpu_seconds = 1 * 450.0 + 2 * (300.0 - 150.0)
    assert result.end_s == 450.0
    assert result.gpu_hours == pytest.approx(gpu_seconds / 3600.0)
    assert result.replica_change_s.tolist() == [0.0, 150.0, 300.0]
    assert result.replicas_after_change.tolist() == [1, 3, 1]
    assert result.scale_events == 2


def saturated_throughput_req_per_s(model, input_tokens, output_tokens, overload=None):
    """All at once (overload None), or steadily at `overload` × the ground-truth throughput."""
    batch = model.max_num_seqs
    count = batch * 20
    if overload is None:
        arrivals_s = [0.0] * count
    else:
        gap_s = ground_truth_replica_seconds(model, input_tokens, output_tokens, batch) / overload
        arrivals_s = [k * gap_s for k in range(count)]
    trace = [TraceRequest(t, input_tokens, output_tokens) for t in arrivals_s]
    settings = SimulationSettings(model=model, initial_replicas=1, queue_timeout_seconds=1e9)
    result = simulate(trace, settings, StaticAutoscaler(1))
    assert result.served == count
    return count / result.finish_s.max()


@pytest.mark.parametrize("overload", [None, 2.0])
@pytest.mark.parametrize(("input_tokens", "output_tokens"), [(512, 128), (2048, 32), (128, 512)])
def test_saturated_throughput_matches_the_ground_truth(input_tokens, output_tokens, overload):
    measured = saturated_throughput_req_per_s(MODEL, input_tokens, output_tokens, overload)
    expected = 1.0 / ground_truth_replica_seconds(
        MODEL, input_tokens, output_tokens, MODEL.max_num_seqs
    )
    assert measured == pytest.approx(expected, rel=0.10)


@pytest.mark.serial  # measures the real emulator's throughput
def test_saturated_throughput_matches_the_engine_emulator():
    # Steps of ~25 ms, so the emulator's own Python overhead stays small against them (at ~15 ms
    # a slower machine measured it 10-12 % below the simulator).
    raw = {
        "name": "slow",
        "max_num_seqs": 8,
        "kv_cache_tokens": 100_000,
        "context_length": 4096,
        "prefill_seconds_per_token": 2e-5,
        "decode_step_base_seconds": 2e-2,
        "decode_seconds_per_sequence": 5e-4,
        "decode_seconds_per_context_token": 1e-6,
    }
    config = parse_config({"seed": 1, "models": [raw]})
    spec = runner.SuiteSpec(
        grid=((256, 32),),
        slo_ttft_p95_ms=10_000,
        slo_tpot_p95_ms=1_000,
        duration_per_point_seconds=3.0,
        request_timeout_seconds=10,
    )

    async def measure(url):
        loopback = outbound.HostPolicy.parse("BENCHMARK_ALLOWED_HOSTS", ["127.0.0.0/8"])
        session = runner.make_session(8, timeout_seconds=10, host_policy=loopback)
        try:
            endpoint = runner.Endpoint(url, "slow", session=session)
            return await runner.measure_point(
                endpoint, input_len=256, output_len=32, concurrency=8, spec=spec
            )
        finally:
            await session.close()

    with BackgroundEmulator(config) as emulator:
        point = asyncio.run(measure(emulator.url))

    simulated = saturated_throughput_req_per_s(config.models[0], 256, 32)
    print(f"emulator {point.requests_per_s:.2f} req/s, simulator {simulated:.2f} req/s")
    assert point.error_count == 0
    # 15 %: the emulator's Python overhead, in the runner's process, varies with the machine.
    assert simulated == pytest.approx(point.requests_per_s, rel=0.15)


def test_a_lone_request_gets_its_first_token_after_its_prefill_step_then_one_per_step():
    settings = SimulationSettings(model=MODEL, initial_replicas=1)
    result = simulate([TraceRequest(5.0, 1000, 101)], settings, StaticAutoscaler(1))

    prefill_step_s = step_seconds(
        MODEL, prefill_tokens=1000, running_sequences=1, context_tokens=1000
    )
    assert result.start_s[0] == 5.0
    assert result.ttft_s[0] == pytest.approx(prefill_step_s)
    # Decode steps read a context growing from 1001 to 1100 tokens: the mean is at 1050.5.
    mean_step_s = step_seconds(MODEL, prefill_tokens=0, running_sequences=1, context_tokens=1050.5)
    assert result.tpot_s[0] == pytest.approx(mean_step_s, rel=1e-9)


def test_a_replica_asked_for_at_t_serves_nothing_before_t_plus_its_cold_start():
    settings = SimulationSettings(model=MODEL, cold_start_seconds=30.0, queue_timeout_seconds=60.0)
    # Scaled to zero until the tick at 15 s asks for one replica, ready at 45 s.
    autoscaler = ScheduledAutoscaler([(15.0, 1)])
    trace = [TraceRequest(1.0, 100, 10), TraceRequest(20.0, 100, 10), TraceRequest(50.0, 100, 10)]
    result = simulate(trace, settings, autoscaler)

    assert (result.outcome == SERVED).all()
    assert result.start_s.tolist()[:2] == [45.0, 45.0]
    assert result.start_s[2] == 50.0
    assert result.ttft_s[0] > 44.0


def test_requests_time_out_while_the_model_stays_scaled_to_zero():
    settings = SimulationSettings(model=MODEL, queue_timeout_seconds=20.0)
    trace = [TraceRequest(1.0, 100, 10), TraceRequest(2.0, 100, 10)]
    result = simulate(trace, settings, StaticAutoscaler(0))

    assert (result.outcome == TIMED_OUT).all()
    assert result.finish_s.tolist() == [21.0, 22.0]
    assert result.gpu_hours == 0.0


def test_the_autoscaler_sees_the_last_window_and_never_the_future():
    seen = []

    class Recorder:
        def decide(self, observation):
            seen.append(observation)
            return 1

    trace = [TraceRequest(t, 100, 10) for t in (1.0, 2.0, 16.0)]
    settings = SimulationSettings(
        model=MODEL, initial_replicas=1, request_mu=lambda r: 2.0, horizon_s=30.0
    )
    simulate(trace, settings, Recorder())

    assert [o.timestamp_s for o in seen] == [0.0, 15.0, 30.0]
    assert [o.arrived_requests for o in seen] == [0, 2, 1]
    assert [o.completed_requests for o in seen] == [0, 2, 1]
    assert seen[1].mu_used_by_client == {"default": 4.0}
    assert seen[1].ready_replicas == seen[1].current_replicas == 1


def test_the_same_trace_gives_the_same_result():
    settings = SimulationSettings(model=MODEL, initial_replicas=2, cold_start_seconds=20.0)
    autoscaler = ScheduledAutoscaler([(0.0, 2), (120.0, 4), (400.0, 2)])
    first = simulate(poisson_trace(7, 15.0, 600.0), settings, autoscaler)
    second = simulate(poisson_trace(7, 15.0, 600.0), settings, autoscaler)
    other = simulate(poisson_trace(8, 15.0, 600.0), settings, autoscaler)

    for name in ("start_s", "first_token_s", "finish_s", "outcome"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert first.summary() == second.summary()
    assert first.summary() != other.summary()


def test_one_simulated_hour_at_20_requests_per_second_runs_in_seconds():
    trace = poisson_trace(3, 20.0, 3600.0)
    settings = SimulationSettings(model=MODEL, initial_replicas=5)
    started = time.perf_counter()
    result = simulate(trace, settings, StaticAutoscaler(5))
    elapsed_s = time.perf_counter() - started

    print(f"simulated 1 h at 20 req/s ({len(trace)} requests) in {elapsed_s:.2f} s")
    assert_every_request_resolved(result, len(trace))
    assert elapsed_s < 30.0


def test_a_burst_of_prompts_is_prefilled_a_token_budget_at_a_time():
    # Six 1,000-token prompts at once on one replica with a 2,000-token step budget: first
    # tokens in three waves of two, each a prefill step later than the one before.
    model = ModelConfig(name="m", max_num_batched_tokens=2000, prefill_seconds_per_token=2e-4)
    burst = [TraceRequest(1.0, 1000, 5) for _ in range(6)]
    result = simulate(
        burst, SimulationSettings(model=model, initial_replicas=1), StaticAutoscaler(1)
    )
    waves = np.unique(np.round(result.first_token_s, 9))
    assert len(waves) == 3
    assert np.all(np.diff(waves) >= 2000 * 2e-4)
    assert result.served == 6
    # Without a budget that binds, all six share one prefill step.
    together = simulate(
        burst,
        SimulationSettings(model=replace(model, max_num_batched_tokens=10_000), initial_replicas=1),
        StaticAutoscaler(1),
    )
    assert len(np.unique(np.round(together.first_token_s, 9))) == 1
