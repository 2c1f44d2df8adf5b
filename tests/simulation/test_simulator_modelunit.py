"""The live allocation policy driving the simulator: it follows demand with what it observes."""

import pytest

from dataplane.emulator.config import ModelConfig
from simulation.engine import SimulationSettings, simulate
from simulation.engine.modelunit import ModelUnitAutoscaler
from simulation.engine.policy_context import PolicyContext
from simulation.engine.profile import ground_truth_replica_seconds
from simulation.engine.traces import TraceRequest

MODEL = ModelConfig(
    name="m",
    cold_start_seconds=30,
    max_num_seqs=32,
    kv_cache_tokens=200_000,
    decode_step_base_seconds=0.01,
    decode_seconds_per_sequence=1e-4,
    prefill_seconds_per_token=2e-5,
)


def request_mu(request: TraceRequest) -> float:
    seconds = ground_truth_replica_seconds(
        MODEL, request.input_tokens, request.output_tokens, batch_size=MODEL.max_num_seqs
    )
    return seconds * 100 / 60


def steady(rate_req_per_s: float, start_s: float, end_s: float) -> list[TraceRequest]:
    step = 1 / rate_req_per_s
    count = int((end_s - start_s) * rate_req_per_s)
    return [TraceRequest(start_s + i * step, 2000, 400) for i in range(count)]


def context(requests, **overrides) -> PolicyContext:
    mean_mu = sum(request_mu(r) for r in requests) / len(requests)
    values = dict(
        replica_mu_per_minute=100.0,
        request_mu=request_mu,
        max_replicas=20,
        max_num_seqs=MODEL.max_num_seqs,
        cold_start_seconds=30,
        tick_seconds=15,
        mean_request_mu=mean_mu,
    )
    return PolicyContext(**(values | overrides))


def replicas_at(result, t: float) -> int:
    index = max(i for i, at in enumerate(result.replica_change_s) if at <= t)
    return int(result.replicas_after_change[index])


def test_the_live_policy_scales_up_with_demand_and_down_after_the_window():
    # 10 minutes busy, 15 minutes quiet.
    requests = steady(12.0, 0, 600) + steady(1.0, 600, 1500)
    ctx = context(requests)
    busy_mu_per_minute = 12.0 * 60 * ctx.mean_request_mu
    # Starting near the busy fleet: a cold ramp from one replica is physics, not policy.
    result = simulate(
        requests,
        SimulationSettings(model=MODEL, initial_replicas=4, request_mu=request_mu),
        ModelUnitAutoscaler(ctx),
    )
    needed = busy_mu_per_minute / (100 * ctx.target_utilisation)
    assert replicas_at(result, 550) >= needed
    # Not scaled down within the stabilisation window of the drop, but well after it.
    assert replicas_at(result, 650) >= needed
    assert replicas_at(result, 1450) < replicas_at(result, 550)
    assert result.served == len(requests)
    assert result.slo_attainment > 0.95


def test_a_reservation_keeps_capacity_hot_before_any_traffic():
    requests = steady(0.5, 600, 700)
    ctx = context(requests, reservations_mu_per_minute={"default": 250.0}, keep_warm=True)
    result = simulate(
        requests,
        SimulationSettings(model=MODEL, initial_replicas=0, request_mu=request_mu),
        ModelUnitAutoscaler(ctx),
    )
    assert replicas_at(result, 300) == pytest.approx(4)  # 250 MU/min at 80 % of 100
