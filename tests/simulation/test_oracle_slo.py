"""The references found by search in the simulator (simulation.engine.oracle_slo): oracle-slo,
the hindsight trajectory at the TTFT SLO, and static-slo, the cheapest static fleet that keeps
it; and the early stop a search uses. Pure Python on small synthetic traces; no database.
"""

import json
from io import StringIO

import numpy as np
import pytest
from django.core.management import call_command

from dataplane.emulator.config import ModelConfig
from simulation.engine import SimulationSettings, StaticAutoscaler, simulate
from simulation.engine.compare import METRICS, build_context, compare
from simulation.engine.fleet import SimulationResult
from simulation.engine.oracle import OracleAutoscaler
from simulation.engine.oracle_slo import Scored, WindowPlan, cheapest_static
from simulation.engine.traces import TraceRequest

MODEL = ModelConfig(name="t", max_num_seqs=16, cold_start_seconds=60.0)
SEARCHED = ["static-slo", "oracle-slo"]


def poisson(rng, rate_req_per_s: float, start_s: float, end_s: float) -> list[TraceRequest]:
    n = rng.poisson(rate_req_per_s * (end_s - start_s))
    arrivals = np.sort(rng.uniform(start_s, end_s, n))
    return [
        TraceRequest(float(t), int(rng.integers(100, 400)), int(rng.integers(20, 200)))
        for t in arrivals
    ]


def bursty_trace(seed: int = 5) -> list[TraceRequest]:
    """Quiet traffic with three one-minute bursts of five times its rate, minutes apart."""
    rng = np.random.default_rng(seed)
    requests = poisson(rng, 4.0, 0, 900)
    for start_s in (180, 420, 720):
        requests += poisson(rng, 20.0, start_s, start_s + 60)
    return sorted(requests, key=lambda r: r.arrival_s)


@pytest.fixture(scope="module")
def bursty_report():
    policies = ["oracle", "modelunit", *SEARCHED]
    return compare(bursty_trace(), model=MODEL, policies=policies, slo_ttft_ms=2000)["policies"]


def test_oracle_slo_keeps_the_slo_on_a_bursty_scenario(bursty_report):
    oracle_slo = bursty_report["oracle-slo"]
    assert oracle_slo["slo_attainment"] >= 0.99
    # It knows when the bursts come: it keeps the SLO on less than any static fleet that does.
    assert oracle_slo["gpu_hours"] < bursty_report["static-slo"]["gpu_hours"]
    assert oracle_slo["oracle_slo_savings_share"] == pytest.approx(1.0)


def test_the_share_of_oracle_slos_saving_is_measured_over_the_cheapest_static_fleet(
    bursty_report,
):
    static = bursty_report["static-slo"]["gpu_hours"]
    headroom = static - bursty_report["oracle-slo"]["gpu_hours"]
    for name, row in bursty_report.items():
        assert set(row) == set(METRICS)
        assert row["savings_vs_static_slo"] == pytest.approx(1 - row["gpu_hours"] / static), name
        expected = (static - row["gpu_hours"]) / headroom
        assert row["oracle_slo_savings_share"] == pytest.approx(expected), name
    assert bursty_report["static-slo"]["oracle_slo_savings_share"] == 0.0
    assert bursty_report["static-slo"]["static_replicas"] >= 1
    assert np.isnan(bursty_report["modelunit"]["static_replicas"])


def test_static_slo_is_the_cheapest_static_fleet_that_keeps_the_slo(bursty_report):
    static = bursty_report["static-slo"]
    replicas = int(static["static_replicas"])
    assert static["slo_attainment"] >= 0.99
    assert static["scale_events"] == 0
    # One replica fewer (the search capped there) misses the objective.
    capped = compare(
        bursty_trace(),
        model=MODEL,
        policies=["static-slo"],
        slo_ttft_ms=2000,
        max_replicas=replicas - 1,
    )["policies"]["static-slo"]
    assert capped["static_replicas"] == replicas - 1
    assert capped["slo_attainment"] < 0.99


def test_without_the_searched_policies_their_columns_are_empty():
    requests = poisson(np.random.default_rng(1), 2.0, 0, 120)
    report = compare(requests, model=MODEL, policies=["oracle"], slo_ttft_ms=2000)["policies"]
    for row in report.values():
        assert np.isnan(row["savings_vs_static_slo"])
        assert np.isnan(row["oracle_slo_savings_share"])
    assert report["static-peak"]["static_replicas"] >= 1


def fake_runs(attainment_by_replicas: dict[int, float], asked: list[int]):
    """A run of n static replicas whose scored attainment is given, recording what is asked."""

    def run(n: int) -> Scored:
        asked.append(n)
        outcome = np.zeros(1000, dtype=np.int8)
        outcome[: round(1000 * (1 - attainment_by_replicas[n]))] = 2  # timed out
        result = SimulationResult(
            arrival_s=np.zeros(1000),
            start_s=np.zeros(1000),
            first_token_s=np.zeros(1000),
            finish_s=np.zeros(1000),
            outcome=outcome,
            ttft_s=np.zeros(1000),
            tpot_s=np.zeros(1000),
            replica_change_s=np.zeros(1),
            replicas_after_change=np.asarray([n]),
            end_s=1.0,
            gpu_hours=float(n),
            ttft_slo_seconds=2.0,
            scale_events=0,
        )
        return Scored(result, result)

    return run


@pytest.mark.parametrize("first_guess", [1, 5, 9, 14, 30])
def test_the_static_search_finds_the_fewest_replicas_that_keep_the_objective(first_guess):
    # 12 replicas is the first to keep 99 %.
    table = {n: min(1.0, 0.5 + 0.04 * n) if n < 12 else 0.995 for n in range(1, 41)}
    asked: list[int] = []
    replicas, scored = cheapest_static(
        fake_runs(table, asked), first_guess=first_guess, max_replicas=40
    )
    assert replicas == 12
    assert scored.scored.gpu_hours == 12
    # Galloping, then bisecting: a handful of runs, none twice.
    assert len(asked) == len(set(asked)) <= 10


def test_the_static_search_reuses_a_run_already_made_and_stops_at_the_cap():
    table = {n: 0.9 for n in range(1, 9)}
    asked: list[int] = []
    known = {4: fake_runs(table, [])(4)}
    replicas, scored = cheapest_static(
        fake_runs(table, asked), first_guess=4, max_replicas=8, known=known
    )
    assert (replicas, scored.scored.gpu_hours) == (8, 8)  # none keeps it: the cap
    assert 4 not in asked


def test_relaxing_the_plan_spends_the_budget_where_a_replica_fewer_costs_least():
    plan = WindowPlan(
        counts=np.asarray([3, 5, 4, 2]),
        requests=np.asarray([100, 100, 100, 100]),
        misses=np.asarray([0, 1, 0, 0]),
        # One fewer: +30, +2 and +9 misses; the last window is at its floor.
        misses_one_fewer=np.asarray([30, 3, 9, -1]),
    )
    every = np.ones(4, dtype=bool)
    assert plan.relaxed(5.0, every).tolist() == [3, 4, 4, 2]
    assert plan.relaxed(11.0, every).tolist() == [3, 4, 3, 2]
    assert plan.relaxed(11.0, np.asarray([True, False, True, True])).tolist() == [3, 5, 3, 2]
    assert plan.relaxed(0.0, every).tolist() == [3, 5, 4, 2]


def test_a_run_told_its_most_misses_stops_once_past_them_and_not_before():
    requests = poisson(np.random.default_rng(2), 30.0, 0, 300)
    settings = SimulationSettings(model=MODEL, initial_replicas=1)
    whole = simulate(requests, settings, StaticAutoscaler(1))
    misses = int(np.count_nonzero(~((whole.outcome == 0) & (whole.ttft_s <= 2.0))))
    assert misses > 100

    enough = simulate(
        requests, SimulationSettings(model=MODEL, initial_replicas=1, max_misses=misses),
        StaticAutoscaler(1),
    )  # fmt: skip
    assert not enough.stopped
    assert enough.gpu_hours == whole.gpu_hours
    assert np.array_equal(enough.outcome, whole.outcome)

    stopped = simulate(
        requests, SimulationSettings(model=MODEL, initial_replicas=1, max_misses=100),
        StaticAutoscaler(1),
    )  # fmt: skip
    assert stopped.stopped
    assert stopped.end_s < whole.end_s
    assert stopped.slo_attainment < whole.slo_attainment + 1e-9


def test_the_simulate_command_runs_the_searched_policies():
    out = StringIO()
    call_command(
        "simulate",
        "--trace",
        "simulation/data/traces/AzureLLMInferenceTrace_code_2023.csv",
        "--scale",
        "0.2",
        "--policies",
        "oracle-slo,static-slo",
        "--json",
        stdout=out,
    )
    report = json.loads(out.getvalue())["policies"]
    assert list(report) == ["static-peak", "oracle-slo", "static-slo"]
    assert report["oracle-slo"]["slo_attainment"] >= 0.99
    assert report["static-slo"]["slo_attainment"] >= 0.99


def test_without_the_reference_only_the_policies_asked_for_run():
    requests = poisson(np.random.default_rng(3), 3.0, 0, 300)
    report = compare(
        requests, model=MODEL, policies=["static-slo"], slo_ttft_ms=2000, reference=False
    )["policies"]
    assert list(report) == ["static-slo"]
    assert np.isnan(report["static-slo"]["savings_vs_static"])
    assert report["static-slo"]["slo_attainment"] >= 0.99


def test_what_a_schedule_asks_for_is_a_floor_on_what_its_run_holds():
    # oracle-slo skips simulating a candidate schedule that asks for more than its best.
    requests = bursty_trace()
    context = build_context(
        requests,
        model=MODEL,
        cold_start_seconds=60.0,
        target_utilisation=0.8,
        tick_seconds=15.0,
        future=True,
    )
    oracle = OracleAutoscaler(context)
    settings = SimulationSettings(model=MODEL, initial_replicas=oracle.initial_replicas())
    result = simulate(requests, settings, oracle)
    last_s = requests[-1].arrival_s
    for from_s in (0.0, 300.0, 600.0):
        held_s = result.since(from_s, 0).gpu_hours * 3600
        asked_s = oracle.asked_replica_seconds(from_s, last_s, 15.0)
        assert 0.9 * held_s <= asked_s <= held_s + 1e-6
