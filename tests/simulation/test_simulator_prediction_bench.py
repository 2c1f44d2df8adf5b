"""The bench side of issue 36: compare()'s forecast accuracy (forecast_mape, forecast_fitted),
the clairvoyant limit policy (modelunit-clairvoyant) and the two-week scenario. Pure Python on
small synthetic traces; no database.
"""

import csv
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dataplane.emulator.config import ModelConfig
from simulation.engine.compare import (
    METRICS,
    MODELUNIT_CLAIRVOYANT,
    build_context,
    compare,
    known_policies,
)
from simulation.engine.modelunit import ClairvoyantDemand
from simulation.engine.traces import TraceRequest, load_trace
from simulation.management.commands.simulate import load_scenario

MODEL = ModelConfig(name="t", max_num_seqs=16, cold_start_seconds=60.0)
SCENARIOS = Path("simulation/data/scenarios")
CONVERSATION = Path("simulation/data/traces/AzureLLMInferenceTrace_conv_2023.csv")
LIVE = ["modelunit", "modelunit-reactive", MODELUNIT_CLAIRVOYANT]


def ramp(seed: int = 3) -> list[TraceRequest]:
    """Poisson arrivals from 2 to 12 req/s and back over 20 minutes."""
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.exponential(1 / 12)
        if t >= 1200:
            return out
        if rng.random() < (2 + 10 * (1 - abs(t - 600) / 600)) / 12:
            out.append(TraceRequest(t, int(rng.integers(100, 400)), int(rng.integers(20, 200))))


@pytest.fixture(scope="module")
def live_report():
    return compare(ramp(), model=MODEL, policies=LIVE, slo_ttft_ms=2000)["policies"]


def test_compare_reports_the_live_policies_forecast_accuracy(live_report):
    for name, row in live_report.items():
        assert set(row) == set(METRICS), name
    # Too short for a Holt-Winters fit (two days): the prediction is the level (plus, for the
    # clairvoyant, the exact rise), scored against the minute it fell in.
    for name in LIVE:
        assert live_report[name]["forecast_fitted"] is False
        assert 0 < live_report[name]["forecast_mape"] < 1, name
    # A policy without a forecast has none to score.
    assert math.isnan(live_report["static-peak"]["forecast_mape"])
    assert live_report["static-peak"]["forecast_fitted"] is False


def test_the_clairvoyant_policy_is_known_and_keeps_the_slo(live_report):
    assert MODELUNIT_CLAIRVOYANT in known_policies()
    row = live_report[MODELUNIT_CLAIRVOYANT]
    assert row["slo_attainment"] >= 0.99
    assert 0 < row["gpu_hours"] <= live_report["static-peak"]["gpu_hours"]


def test_the_clairvoyant_forecast_is_the_exact_demand_of_the_next_cold_start():
    requests = [TraceRequest(t, 200, 100) for t in (5.0, 65.0, 70.0, 130.0, 131.0, 132.0, 250.0)]
    context = build_context(
        requests, model=MODEL, cold_start_seconds=60.0, target_utilisation=0.8, tick_seconds=15
    )
    mu = context.request_mu(requests[0])
    demand = ClairvoyantDemand(replace(context, future_requests=tuple(requests)))
    # At 50 s the next cold start and tick (75 s) touch minutes 0, 1 and 2: three requests in
    # minute 2, the busiest. Nothing measured yet: the level is 0, so the lift is all of it.
    figures = demand.forecast_figures(50.0)
    assert figures.at_level_mu_per_minute == 0.0
    assert figures.ahead_mu_per_minute == pytest.approx(3 * mu)
    assert figures.next_hour_peak_mu_per_minute is None
    # From 186 s: minutes 3 and 4, one request.
    assert demand.forecast_figures(186.0).ahead_mu_per_minute == pytest.approx(mu)


def test_the_two_week_scenario_loads_and_spans_two_weeks():
    scenario = load_scenario(str(SCENARIOS / "demo_two_weeks.json"))
    assert scenario["cold_start_seconds"] == 60
    assert scenario["reservations"]
    with open(SCENARIOS / "demo_two_weeks.csv", newline="") as handle:
        windows = list(csv.DictReader(handle))
    starts = sorted({int(row["window_start_s"]) for row in windows})
    assert starts[0] == 0 and starts[-1] + 600 >= 14 * 86400
    assert {row["client"] for row in windows} == {"acme", "globex"}
    # The rate windows load (a thousandth of their rate, for speed) and span the two weeks.
    requests = load_trace(
        SCENARIOS / "demo_two_weeks.csv", sizes_path=CONVERSATION, scale=0.001, seed=0
    )
    assert requests and max(r.arrival_s for r in requests) >= 13.5 * 86400
