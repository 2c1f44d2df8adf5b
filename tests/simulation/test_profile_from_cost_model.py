"""A simulated replica from a fitted cost model: saturated, it serves the cost model's R = 100 MU
per minute of the workload it is derived for, whatever features the fit selected, and on another
GPU type the exchange rate's R · t_ref / t_own. Pure Python; no database."""

from pathlib import Path

import pytest

from simulation.engine import SERVED, SimulationSettings, StaticAutoscaler, simulate
from simulation.engine.compare import request_mu_of_weights
from simulation.engine.profile import (
    ConfigError,
    WorkloadMix,
    ground_truth_replica_seconds,
    profile_from_cost_model,
    saturated_batch,
)
from simulation.engine.traces import TraceRequest, load_trace

AZURE_CONV = (
    Path(__file__).resolve().parents[2]
    / "simulation/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
)
# Replica-seconds per unit, of the shapes a fit gives (every feature, and the seeds' α/β/γ).
CONTEXT_AWARE = {
    "input_tokens": 1.2e-4,
    "output_tokens": 1.1e-4,
    "input_x_output_per_1000": 4.0e-5,
    "output_sq_per_1000": 3.0e-5,
    "request": 0.02,
}
PLAIN = {"input_tokens": 1.5e-4, "output_tokens": 2.0e-4, "request": 0.05}


@pytest.fixture(scope="module")
def conversation_sizes():
    """Four thousand requests of Azure's conversation trace, as a saturated queue."""
    requests = load_trace(AZURE_CONV)[:4000]
    return [TraceRequest(0.0, r.input_tokens, r.output_tokens) for r in requests]


def served_mu_per_minute(requests, model, price) -> float:
    """MU/min one replica serves with a queue that never empties, priced by `price`."""
    settings = SimulationSettings(model=model, initial_replicas=1, queue_timeout_seconds=1e9)
    result = simulate(requests, settings, StaticAutoscaler(1))
    served = [r for r, outcome in zip(requests, result.outcome, strict=True) if outcome == SERVED]
    assert len(served) == len(requests)
    return sum(price(r) for r in served) / (result.finish_s.max() / 60.0)


def mix_of(requests) -> WorkloadMix:
    return WorkloadMix.of([(r.input_tokens, r.output_tokens) for r in requests])


@pytest.mark.parametrize(
    "weights", [CONTEXT_AWARE, PLAIN], ids=["every feature", "alpha-beta-gamma"]
)
@pytest.mark.parametrize(
    ("max_num_seqs", "kv_cache_tokens"),
    [(256, 200_000), (64, 200_000), (256, 60_000)],
    ids=["kv-bound", "batch-bound", "small-kv"],
)
def test_a_replica_from_a_cost_model_serves_r_mu_per_minute_of_its_workload(
    conversation_sizes, weights, max_num_seqs, kv_cache_tokens
):
    model = profile_from_cost_model(
        name="fitted",
        weights_replica_seconds=weights,
        mix=mix_of(conversation_sizes),
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=kv_cache_tokens,
        context_length=8192,
    )
    measured = served_mu_per_minute(conversation_sizes, model, request_mu_of_weights(weights))
    assert measured == pytest.approx(100.0, rel=0.02)


def test_on_another_gpu_type_the_replica_serves_the_exchange_rate_in_reference_mu(
    conversation_sizes,
):
    # The deployment's own GPU is twice as fast as the reference one: its cost model halves
    # every weight. Requests are priced (billed) by the reference cost model.
    own = {key: value / 2 for key, value in CONTEXT_AWARE.items()}
    mix = mix_of(conversation_sizes)
    model = profile_from_cost_model(name="fast", weights_replica_seconds=own, mix=mix)
    measured = served_mu_per_minute(conversation_sizes, model, request_mu_of_weights(CONTEXT_AWARE))
    assert measured == pytest.approx(200.0, rel=0.02)


def test_the_emulators_own_cost_recovers_the_emulators_profile():
    # Weights a fit of the built-in profile would find for a mix that fills the batch.
    mix = WorkloadMix(input_tokens=500, output_tokens=100, input_x_output=50_000, output_sq=10_000)
    batch = saturated_batch(mix, max_num_seqs=256, kv_cache_tokens=200_000)
    assert batch == 256
    weights = {
        "input_tokens": 1.0e-4,
        "output_tokens": 7.0e-3 / batch + 6.0e-5,
        "input_x_output_per_1000": 1000 * 5.0e-8,
        "output_sq_per_1000": 500 * 5.0e-8,
    }
    model = profile_from_cost_model(name="8b", weights_replica_seconds=weights, mix=mix)
    assert model.prefill_seconds_per_token == pytest.approx(1.0e-4)
    assert model.decode_step_base_seconds == pytest.approx(7.0e-3)
    assert model.decode_seconds_per_sequence == pytest.approx(6.0e-5)
    assert model.decode_seconds_per_context_token == pytest.approx(5.0e-8)
    # So each request costs what the cost model says, not only the mean one.
    assert ground_truth_replica_seconds(model, 2000, 300, batch) == pytest.approx(
        2000 * 1e-4 + 300 * weights["output_tokens"] + 5e-8 * (2000 * 300 + 300**2 / 2)
    )


def test_a_cost_model_whose_tokens_cost_nothing_is_refused_naming_the_weight():
    with pytest.raises(ConfigError, match="weights_replica_seconds.output_tokens"):
        profile_from_cost_model(
            name="x",
            weights_replica_seconds={"input_tokens": 1e-4},
            mix=WorkloadMix(100, 10, 1000, 100),
        )
