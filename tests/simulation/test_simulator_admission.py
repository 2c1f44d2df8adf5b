"""The simulator behind the live admission: the one bucket rule with the live policy's allowances,
refused demand fed back to the policy, and the refusals a planner reads per class of traffic.
Pure Python; no database."""

from pathlib import Path

import numpy as np
import pytest

from dataplane.emulator.config import ModelConfig
from simulation.engine import REFUSED, SERVED, SimulationSettings, simulate
from simulation.engine.admission import (
    BEST_EFFORT,
    GUARANTEED,
    REFUSED_GUARANTEED,
    TokenBucketAdmission,
    within_reservation,
)
from simulation.engine.admission import REFUSED as REFUSED_CLASS
from simulation.engine.compare import compare, request_mu_of_model
from simulation.engine.modelunit import ModelUnitAutoscaler, behind_admission
from simulation.engine.policy_context import PolicyContext
from simulation.engine.traces import TraceRequest, load_trace, split_clients
from simulation.management.commands.simulate import BUILT_IN_MODEL
from tests.support.once import once_per_run

AZURE_CONV = (
    Path(__file__).resolve().parents[2]
    / "simulation/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
)
MODEL = ModelConfig(name="m", cold_start_seconds=30.0, max_num_seqs=64)
request_mu = request_mu_of_model(MODEL)


def steady(rate_req_per_s: float, start_s: float, end_s: float, client: str = "default"):
    count = int((end_s - start_s) * rate_req_per_s)
    return [TraceRequest(start_s + i / rate_req_per_s, 1000, 200, client) for i in range(count)]


def mu_per_minute(rate_req_per_s: float) -> float:
    return rate_req_per_s * 60 * request_mu(TraceRequest(0.0, 1000, 200))


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    # Two tests read it, often on two workers: simulated once per run (tests/support/once.py).
    return once_per_run(tmp_path_factory, "simulator-admission-conversation", _conversation)


def _conversation():
    """Azure's conversation trace at about ten replicas (×5.8), dealt half to acme, which
    reserves about its mean (250 MU/min: its busiest minutes go beyond it), half to globex, a
    best-effort customer without a reservation."""
    requests = split_clients(
        load_trace(AZURE_CONV, scale=5.8, seed=0), {"acme": 0.5, "globex": 0.5}, seed=0
    )
    report = compare(
        requests,
        model=BUILT_IN_MODEL,
        policies=["modelunit"],
        slo_ttft_ms=2000,
        reservations={"acme": 250.0},
    )["policies"]
    return requests, report


@pytest.mark.slow
def test_on_azures_conversation_trace_the_live_policy_keeps_the_reservation_and_its_slo(
    conversation,
):
    _, report = conversation
    modelunit = report["modelunit"]
    # The acceptance of issue 19: admitted guaranteed traffic within its SLO, the requests within
    # the reservation (all but never) refused, and the refused shares reported.
    assert modelunit["guaranteed_slo_attainment"] >= 0.99
    assert modelunit["refused_within_reservation_share"] <= 0.001
    for name, row in report.items():
        for share in ("refused_guaranteed_share", "refused_best_effort_share"):
            assert 0 <= row[share] <= 1, (name, share)
    # Cheaper than the fleet sized for the peak.
    assert modelunit["gpu_hours"] < report["static-peak"]["gpu_hours"]


@pytest.mark.slow
def test_most_of_the_reserved_customers_requests_are_within_its_reservation(conversation):
    # The figure above is over many requests: acme reserves about its mean, so most of its
    # requests are within the reservation and those of its busiest minutes are not.
    requests, _ = conversation
    acme = [r for r in requests if r.client == "acme"]
    arrival = np.asarray([r.arrival_s for r in acme])
    mu = np.asarray([request_mu_of_model(BUILT_IN_MODEL)(r) for r in acme])
    within = within_reservation(
        clients=["acme"] * len(acme),
        arrival_s=arrival,
        mu=mu,
        admitted=np.ones(len(acme), dtype=bool),
        reservations_mu_per_minute={"acme": 250.0},
    )
    assert 0.5 < within.mean() < 0.99


def test_a_request_takes_its_reservation_first_then_its_allowance_else_is_refused():
    admission = TokenBucketAdmission(burst_seconds=1.0)
    admission.set_rates(guaranteed={"acme": 60.0}, best_effort={"acme": 60.0, "globex": 0.0})
    acme, globex = TraceRequest(0.0, 1, 1, "acme"), TraceRequest(0.0, 1, 1, "globex")
    # 60 MU/min with a 1-second burst holds 1 MU in each bucket.
    assert [admission.decide(acme, 1.0, 0.0) for _ in range(3)] == [
        GUARANTEED,
        BEST_EFFORT,
        REFUSED_GUARANTEED,  # acme holds a reservation: refused in the guaranteed class
    ]
    assert admission.decide(globex, 1.0, 0.0) == REFUSED_CLASS
    # New rates, as a tick rewrites them: globex gets an allowance.
    admission.set_rates(guaranteed={"acme": 60.0}, best_effort={"globex": 60.0})
    assert admission.decide(globex, 1.0, 0.0) == BEST_EFFORT


def test_a_request_is_within_the_reservation_while_the_admitted_minute_fits_in_it():
    # acme reserves 10 MU/min: 3 + 3 + 3 MU fit in a minute, 5 more do not.
    arrival = np.array([0.0, 10.0, 20.0, 25.0, 75.0, 5.0])
    mu = np.array([3.0, 3.0, 3.0, 5.0, 3.0, 1.0])
    clients = ["acme"] * 5 + ["globex"]  # globex has no reservation: never within one

    def within(admitted):
        return within_reservation(
            clients=clients,
            arrival_s=arrival,
            mu=mu,
            admitted=np.asarray(admitted),
            reservations_mu_per_minute={"acme": 10.0},
        ).tolist()

    # At 75 s the minute before holds the requests of 20 s and 25 s: 3 + 5 + 3 > 10 if the
    # 5-MU request was let in, 3 + 3 if it was refused (only what was admitted counts).
    assert within([True] * 6) == [True, True, True, False, False, False]
    assert within([True, True, True, False, True, True]) == [True, True, True, False, True, False]


def test_refused_best_effort_demand_wakes_a_model_at_zero_and_grows_its_fleet():
    # A best-effort customer with no reservation and no history starts sending five replicas'
    # worth of demand (390 MU/min) to a model at zero. Without ready replicas its allowance is
    # 0, so it is refused; refused demand is demand, so the fleet wakes and grows until it is
    # served.
    requests = steady(27.0, 61, 1500, client="newcomer")
    demand = mu_per_minute(27.0)
    context = PolicyContext(
        replica_mu_per_minute=100.0,
        request_mu=request_mu,
        max_replicas=20,
        max_num_seqs=MODEL.max_num_seqs,
        cold_start_seconds=30.0,
        tick_seconds=15.0,
        mean_request_mu=request_mu(requests[0]),
        clients=("newcomer",),
    )
    policy = ModelUnitAutoscaler(context)
    # Admitted under the allowances of the very decisions that size the fleet.
    autoscaler, admission = behind_admission(policy, context, allowances_of=policy)
    result = simulate(
        requests,
        SimulationSettings(
            model=MODEL, initial_replicas=0, request_mu=request_mu, admission=admission
        ),
        autoscaler,
    )
    arrival = result.arrival_s
    first_served = arrival[result.outcome == SERVED].min()
    assert (result.outcome[arrival < 61 + 30] == REFUSED).all()  # a cold start at least
    # The refused burst reaches the next tick (bursts are read to the second), the refusals of
    # a whole minute the tick after that minute closes (as rollups do); then a cold start.
    assert first_served < 61 + 60 + 15 + 30 + 15
    late = arrival > 600
    assert np.mean(result.outcome[late] == REFUSED) < 0.01
    assert np.mean(result.outcome[late] == SERVED) > 0.99
    at_1400 = np.searchsorted(result.replica_change_s, 1400.0, side="right") - 1
    assert result.replicas_after_change[at_1400] >= demand / (100 * 0.8)


def test_behind_a_capped_fleet_a_reservation_is_kept_while_best_effort_is_refused():
    # Three replicas at most (240 MU/min at 80 %): acme reserves 150 MU/min and uses 120 of it,
    # globex wants twice what is left. Every policy is admitted under the live allowances.
    acme_rate = 120 / mu_per_minute(1.0)
    globex_rate = 240 / mu_per_minute(1.0)
    requests = sorted(
        steady(acme_rate, 0, 900, "acme") + steady(globex_rate, 0, 900, "globex"),
        key=lambda r: r.arrival_s,
    )
    report = compare(
        requests,
        model=MODEL,
        policies=["hpa-rps", "modelunit"],
        slo_ttft_ms=2000,
        reservations={"acme": 150.0},
        max_replicas=3,
    )["policies"]
    for name, row in report.items():
        assert row["refused_guaranteed_share"] == 0, name
        assert row["refused_within_reservation_share"] == 0, name
        assert row["guaranteed_slo_attainment"] >= 0.99, name
        # globex may have what the reservation leaves of 3 × 80 MU/min, less acme's even share
        # of it: about (240 − 150) × 0.9 of the 240 it asks for.
        assert 0.5 < row["refused_best_effort_share"] < 0.75, name


def test_without_admission_every_request_is_let_in():
    # One replica (80 MU/min at 80 %) and globex asking for 140 MU/min.
    requests = sorted(
        steady(1.0, 0, 300, "acme") + steady(10.0, 0, 300, "globex"), key=lambda r: r.arrival_s
    )
    kwargs = {
        "model": MODEL,
        "policies": ["static-peak"],
        "slo_ttft_ms": 2000,
        "reservations": {"acme": 1.0},
        "max_replicas": 1,
    }
    gated = compare(requests, **kwargs)["policies"]["static-peak"]
    open_door = compare(requests, **kwargs, admission=False)["policies"]["static-peak"]
    assert gated["refused_best_effort_share"] > 0.4
    assert open_door["refused_best_effort_share"] == 0
    assert open_door["refused_guaranteed_share"] == 0
