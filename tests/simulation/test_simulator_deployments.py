"""The simulator over a model's several deployments: each deployment's replicas follow its own
profile, hold its own GPUs, within its own max and its pool's GPUs (a pool shared by two
deployments holds their replicas together); the live policy sizes each deployment as it does
live, and a baseline's replicas are placed as the live policy places capacity, cheapest MU
first. Pure: no database."""

import math

import pytest

from simulation.engine import SERVED, SimulationSettings, StaticAutoscaler, simulate
from simulation.engine.compare import compare
from simulation.engine.deployments import DeploymentFleet, FleetDeployment
from simulation.engine.modelunit import ModelUnitAutoscaler
from simulation.engine.policy_context import PolicyContext
from simulation.engine.profile import ModelConfig
from simulation.engine.traces import TraceRequest

FAST = ModelConfig(name="fast", cold_start_seconds=30.0)
# Twice the time for every step: half the capacity, twice the latency.
SLOW = ModelConfig(
    name="slow",
    cold_start_seconds=60.0,
    prefill_seconds_per_token=2 * FAST.prefill_seconds_per_token,
    decode_step_base_seconds=2 * FAST.decode_step_base_seconds,
    decode_seconds_per_sequence=2 * FAST.decode_seconds_per_sequence,
    decode_seconds_per_context_token=2 * FAST.decode_seconds_per_context_token,
)


def deployment(name: str, model: ModelConfig, **overrides) -> FleetDeployment:
    values = {
        "name": name,
        "model": model,
        "replica_mu_per_minute": 100.0,
        "pool": "pool",
        "gpus_per_replica": 1,
        "max_replicas": 4,
        "cold_start_seconds": model.cold_start_seconds,
        "gpu_hourly_cost_usd": 1.0,
    }
    return FleetDeployment(**(values | overrides))


def steady(rate_per_s: float, seconds: float, client: str = "default") -> list[TraceRequest]:
    gap = 1.0 / rate_per_s
    return [
        TraceRequest(i * gap, 600 + (i % 7) * 50, 150 + (i % 5) * 20, client)
        for i in range(int(seconds * rate_per_s))
    ]


def test_a_baselines_replicas_are_placed_cheapest_mu_first_within_max_and_pools():
    fleet = DeploymentFleet(
        (
            # 2 GPUs for 50 MU/min at $1 a GPU: $2 a replica, the dearer MU.
            deployment("pairs", SLOW, replica_mu_per_minute=50.0, gpus_per_replica=2),
            deployment("singles", FAST, max_replicas=3, gpu_hourly_cost_usd=1.5),
        ),
        pool_gpus={"pool": 8},
    )
    # Replicas of the cheapest MU's deployment, then the rest of the MU on the next.
    assert fleet.unit.name == "singles"
    assert fleet.place(0) == (0, 0)
    assert fleet.place(2) == (0, 2)
    assert fleet.place(4) == (2, 3)  # 300 MU/min on singles, 100 on two pairs
    # The pool's 8 GPUs are shared: 3 singles leave room for 2 pairs, not the pairs' max 4.
    assert fleet.place(100) == (2, 3)
    assert fleet.capacity_replicas == 4


def test_a_fleet_of_one_deployment_compares_exactly_as_the_model_alone():
    requests = steady(3.0, 240)
    alone = compare(
        requests,
        model=SLOW,
        policies=["static-peak", "kpa", "modelunit"],
        slo_ttft_ms=2000,
        gpus_per_replica=2,
        replica_mu_per_minute=50.0,
        max_replicas=3,
        scale_to_zero_after_seconds=300.0,
    )
    fleet = DeploymentFleet(
        (
            deployment(
                "only",
                SLOW,
                replica_mu_per_minute=50.0,
                gpus_per_replica=2,
                max_replicas=3,
                scale_to_zero_after_seconds=300.0,
            ),
        ),
        pool_gpus={"pool": 8},
    )
    as_fleet = compare(
        requests,
        model=SLOW,
        policies=["static-peak", "kpa", "modelunit"],
        slo_ttft_ms=2000,
        gpus_per_replica=2,
        replica_mu_per_minute=50.0,
        max_replicas=3,
        scale_to_zero_after_seconds=300.0,
        fleet=fleet,
    )
    for name, row in alone["policies"].items():
        other = as_fleet["policies"][name]
        for key, value in row.items():
            assert other[key] == value or (math.isnan(value) and math.isnan(other[key])), key
        only = as_fleet["deployments"][name]["only"]
        assert only["gpu_hours"] == row["gpu_hours"]
        assert only["replica_hours"] == pytest.approx(row["gpu_hours"] / 2)


def test_each_deployments_replicas_follow_their_own_profile_and_hold_their_own_gpus():
    fleet = DeploymentFleet(
        (
            deployment("fast", FAST, max_replicas=1, gpus_per_replica=1),
            deployment("slow", SLOW, replica_mu_per_minute=50.0, gpus_per_replica=2),
        ),
        pool_gpus={"pool": 16},
    )
    requests = steady(2.0, 120)
    settings = SimulationSettings(model=FAST, initial_replicas=3, fleet=fleet)
    # Three fast replicas' worth: the one fast replica, then four slow ones for 200 MU/min.
    result = simulate(requests, settings, StaticAutoscaler(3))
    fast_hours, slow_hours = result.deployment_replica_hours()
    assert fast_hours == pytest.approx(result.end_s / 3600)
    assert slow_hours == pytest.approx(4 * result.end_s / 3600)
    assert result.gpu_hours == pytest.approx(fast_hours + 2 * slow_hours)
    assert result.served == len(requests)
    # Requests routed to the slow replicas take longer: the slowest first tokens are theirs.
    alone = simulate(
        requests, SimulationSettings(model=FAST, initial_replicas=5), StaticAutoscaler(5)
    )
    assert result.tpot_ms(99) > 1.5 * alone.tpot_ms(99)


def test_a_request_too_long_for_one_deployments_kv_cache_runs_on_the_other():
    small = ModelConfig(name="small", kv_cache_tokens=2_000, context_length=2_000)
    large = ModelConfig(name="large", kv_cache_tokens=50_000, context_length=50_000)
    fleet = DeploymentFleet(
        (deployment("small", small, max_replicas=1), deployment("large", large, max_replicas=1)),
        pool_gpus={"pool": 8},
    )
    requests = [
        TraceRequest(0.5, 8_000, 100, "default"),  # fits only the large replica
        TraceRequest(0.6, 500, 50, "default"),
        TraceRequest(0.7, 60_000, 100, "default"),  # fits neither
    ]
    settings = SimulationSettings(model=small, initial_replicas=2, fleet=fleet)
    result = simulate(requests, settings, StaticAutoscaler(2))
    assert list(result.outcome[:2]) == [SERVED, SERVED]
    assert result.outcome[2] != SERVED


def test_the_live_policy_sizes_each_deployment_cheapest_mu_first():
    # The singles are the cheaper MU but only 2 fit; the policy adds pairs for the rest.
    fleet = DeploymentFleet(
        (
            deployment("singles", FAST, max_replicas=2),
            deployment("pairs", SLOW, replica_mu_per_minute=50.0, gpus_per_replica=2),
        ),
        pool_gpus={"pool": 16},
    )
    low = _modelunit_hours(fleet, steady(0.5, 600))
    high = _modelunit_hours(fleet, steady(20.0, 300))  # about 225 MU/min
    assert low[0] > 0 and low[1] == 0  # a little demand: singles only
    assert high[0] > 0 and high[1] > 0  # more than two singles hold: pairs too


def _request_mu(request: TraceRequest) -> float:
    return 100.0 * (request.input_tokens * 1e-4 + request.output_tokens * 2e-4) / 60


def _modelunit_hours(fleet: DeploymentFleet, requests: list[TraceRequest]) -> tuple[float, ...]:
    context = PolicyContext(
        replica_mu_per_minute=100.0,
        request_mu=_request_mu,
        mean_request_mu=sum(map(_request_mu, requests)) / len(requests),
        max_replicas=fleet.capacity_replicas,
        max_num_seqs=FAST.max_num_seqs,
        cold_start_seconds=FAST.cold_start_seconds,
        tick_seconds=15.0,
        clients=("default",),
        fleet=fleet,
    )
    settings = SimulationSettings(model=FAST, fleet=fleet, request_mu=context.request_mu)
    return simulate(requests, settings, ModelUnitAutoscaler(context)).deployment_replica_hours()
