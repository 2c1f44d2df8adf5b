"""Rule 3c of the allocation policy, each mechanism on its own with synthetic traffic (issue
36): the forecast pre-scales a daily ramp a cold start ahead, bursty traffic gets more headroom
than steady traffic of the same mean, the delivered SLO corrects the capacity a replica is
counted at (and says so), a forecast rise blocks a scale-down and a long valley releases at
once; with too little history or prediction off, the reactive rules, and the reasons say which.
Pure: plain data in, decisions out."""

import math
from dataclasses import replace

import numpy as np
import pytest

from capacity.allocation.bursts import bursts
from capacity.allocation.forecast import MIN_HISTORY_MINUTES, Forecast, figures, fit
from capacity.allocation.policy import (
    PREDICTION_MIN_HISTORY_SECONDS,
    CustomerDemand,
    DeploymentState,
    ModelSnapshot,
    PolicySettings,
    PoolState,
    Snapshot,
    decide,
)
from capacity.allocation.slo import SLO_FACTOR_MAX, SLO_FACTOR_MIN

COLD_START_S = 120.0
DAY_S = 86_400


def deployment(current=4, recent=(), utilisation=0.8) -> DeploymentState:
    return DeploymentState(
        deployment_id=1,
        name="llama-h100",
        pool_id=1,
        gpus_per_replica=1,
        mu_per_minute_per_replica=100.0,
        current_replicas=current,
        ready_replicas=current,
        min_replicas=0,
        max_replicas=64,
        cold_start_seconds=COLD_START_S,
        scale_to_zero_after_seconds=600,
        target_utilisation=utilisation,
        cost_per_hour_usd=4.0,
        recent_recommendations=recent,
    )


def model(level_mu_per_minute: float, **fields) -> ModelSnapshot:
    """One best-effort customer using `level` MU/min (its recent mean and busiest minute), with
    prediction on and a burst window of history unless `fields` say otherwise."""
    d = fields.pop("deployment", deployment())
    values = {
        "prediction_enabled": True,
        "history_seconds": PREDICTION_MIN_HISTORY_SECONDS,
    } | fields
    customer = CustomerDemand(1, 0.0, level_mu_per_minute, level_mu_per_minute, idle_seconds=0.0)
    return ModelSnapshot(1, "llama", (customer,), (d,), 0.0, **values)


def decided(m: ModelSnapshot, gain: float | None = None):
    settings = PolicySettings() if gain is None else PolicySettings(slo_gain=gain)
    decisions = decide(Snapshot(models=(m,), pools=(PoolState(1, "pool", 64),), settings=settings))
    return decisions.deployments[0], decisions.models[0]


def reasons(decision) -> dict[str, dict]:
    return {r.code: {"message": r.message, **r.data} for r in decision.reasons}


# -- the forecast -----------------------------------------------------------------------------


def daily_demand(t_s: np.ndarray) -> np.ndarray:
    """MU/min: 100 at night, 900 by day, a ramp from 08:00 to 08:10, down from 20:00."""
    hour = (t_s % DAY_S) / 3600
    up = np.clip((hour - 8) / (10 / 60), 0, 1)
    down = np.clip((hour - 20) / (10 / 60), 0, 1)
    return 100 + 800 * (up - down)


@pytest.fixture(scope="module")
def three_days() -> Forecast:
    minutes = np.arange(3 * 24 * 60) * 60.0
    rng = np.random.default_rng(0)
    history = daily_demand(minutes + 30) * rng.normal(1.0, 0.03, minutes.size)
    forecast = fit(history, end_s=3 * DAY_S)
    assert forecast is not None and forecast.method == "holt-winters daily"
    return forecast


def test_too_little_history_gives_no_forecast():
    assert fit([100.0] * (MIN_HISTORY_MINUTES - 1), end_s=0.0) is None


def test_a_daily_cycle_is_prescaled_ahead_of_the_morning_ramp_by_at_least_the_cold_start(
    three_days,
):
    """Day four, 07:00 to 09:00, a tick every 15 s: the measured level lags demand by half its
    five-minute window. With the forecast, the fleet asks for the day's replicas at least a cold
    start before demand gets there (the ramp's end, 08:10), so they are ready for it; reactive,
    only after."""
    ramp_s = 3 * DAY_S + 8 * 3600
    day_s = ramp_s + 600

    def seen(t: float) -> dict[str, float | None]:
        at = figures(three_days, t, horizon_seconds=COLD_START_S + 15, level_age_seconds=150)
        return {
            "forecast_now_mu_per_minute": at.at_level_mu_per_minute,
            "forecast_ahead_mu_per_minute": at.ahead_mu_per_minute,
            "forecast_next_hour_peak_mu_per_minute": at.next_hour_peak_mu_per_minute,
        }

    day_replicas = math.ceil(900 / 80)  # the day's demand at the target utilisation

    def first_tick_at_day_size(with_forecast: bool) -> float:
        for t in np.arange(ramp_s - 3600, ramp_s + 3600, 15.0):
            level = float(daily_demand(np.array([t - 150]))[0])
            decision, _ = decided(model(level, **(seen(t) if with_forecast else {})))
            if decision.recommended_replicas >= day_replicas:
                return float(t)
        raise AssertionError("never reached the day's size")

    ahead = first_tick_at_day_size(with_forecast=True)
    assert ahead <= day_s - COLD_START_S, (day_s - ahead) / 60
    assert first_tick_at_day_size(with_forecast=False) > day_s
    decision, outcome = decided(
        model(float(daily_demand(np.array([ahead - 150]))[0]), **seen(ahead))
    )
    assert outcome.set_by == "forecast" and outcome.forecast_lift_mu_per_minute > 400
    assert "the forecast's rise" in reasons(decision)["predicted"]["message"]


def test_a_forecast_rise_blocks_a_scale_down_and_a_long_valley_releases_at_once():
    """Ten replicas, demand fallen to 200 MU/min, the last recommendations all 3: reactive, it
    scales down. A forecast back to 800 within the cold start keeps the replicas for it; a
    forecast flat for the hour releases without waiting out the stabilisation window."""
    recent = tuple((age, 3) for age in (15.0, 30.0, 45.0, 60.0))
    low = dict(deployment=deployment(current=10, recent=recent))
    plain, _ = decided(model(200, **low))
    assert plain.target_replicas == 3
    rising, _ = decided(
        model(
            200,
            forecast_now_mu_per_minute=200.0,
            forecast_ahead_mu_per_minute=800.0,
            forecast_next_hour_peak_mu_per_minute=800.0,
            **low,
        )
    )
    assert rising.target_replicas == 10  # (200 + 600) / 80 at the target utilisation
    assert "scale_down" not in reasons(rising)

    # The stabilisation window would hold ten (a recommendation of 10 a minute ago)...
    held = dict(deployment=deployment(current=10, recent=((15.0, 3), (60.0, 10))))
    holding, _ = decided(model(200, **held))
    assert holding.target_replicas == 10 and "stabilising" in reasons(holding)
    # ...a forecast that stays down for the hour releases at once.
    valley, _ = decided(
        model(
            200,
            forecast_now_mu_per_minute=200.0,
            forecast_ahead_mu_per_minute=190.0,
            forecast_next_hour_peak_mu_per_minute=195.0,
            **held,
        )
    )
    assert valley.target_replicas == 3
    assert "forecast_valley" in reasons(valley)


# -- burst headroom ---------------------------------------------------------------------------


def test_a_bursty_trace_gets_more_headroom_than_a_steady_trace_of_the_same_mean():
    """Thirty minutes at 300 MU/min on average: steady (Poisson seconds) or in bursts (the same
    MU in 30 one-second spikes). The headroom is read from each trace, so the bursty one plans
    more replicas for the same mean."""
    rng = np.random.default_rng(1)
    steady = rng.poisson(5.0, 1800).astype(float)
    bursty = np.zeros(1800)
    bursty[rng.choice(1800, 30, replace=False)] = steady.sum() / 30
    found = {}
    for name, seconds in (("steady", steady), ("bursty", bursty)):
        b = bursts(seconds, ttft_slo_seconds=2.0)
        decision, outcome = decided(
            model(
                300.0,
                burst_mu_per_minute=b.burst_mu_per_minute,
                burst_window_busiest_minute_mu=b.busiest_minute_mu,
            )
        )
        found[name] = (decision.recommended_replicas, outcome)
    assert found["bursty"][0] > found["steady"][0]
    assert found["bursty"][1].burst_headroom_mu_per_minute > 0
    assert found["bursty"][1].set_by == "burst_headroom"
    assert found["steady"][1].set_by == "demand"


# -- the delivered SLO ------------------------------------------------------------------------


def test_far_under_the_ttft_target_the_headroom_shrinks_and_over_it_the_headroom_grows():
    """Three ticks each: every request within the SLO (far under target) trusts each replica
    with more, down to the factor's bound; 3 % missed against a 1 % budget counts each replica
    for less. The correction is carried from tick to tick and said in the reasons."""

    def ticks(attainment: float) -> list[tuple[int, float, str]]:
        factor, seen = 1.0, []
        for _ in range(3):
            decision, outcome = decided(
                model(
                    800.0,
                    delivered_slo_attainment=attainment,
                    delivered_requests=5_000,
                    slo_correction_in_force=factor,
                )
            )
            factor = outcome.slo_correction
            seen.append((decision.recommended_replicas, factor, reasons(decision)["predicted"]))
        return seen

    baseline, _ = decided(model(800.0))
    assert baseline.recommended_replicas == 10  # 800 / 80
    met = ticks(1.0)
    assert met[0][0] < 10 and met[0][1] > 1.0  # within one tick
    assert met[-1][2]["slo_code"] == "slo_met_with_margin"
    assert "100.00% of 5000 requests within the TTFT SLO" in met[-1][2]["message"]
    missed = ticks(0.97)
    assert missed[0][0] > 10 and missed[-1][1] == SLO_FACTOR_MIN
    assert missed[-1][2]["slo_code"] == "slo_at_risk" and "(its bound)" in missed[-1][2]["message"]
    assert all(f <= SLO_FACTOR_MAX for _, f, _ in met)


def test_too_few_requests_keep_the_correction_in_force():
    decision, outcome = decided(
        model(
            800.0,
            delivered_slo_attainment=0.5,
            delivered_requests=20,
            slo_correction_in_force=1.1,
        )
    )
    assert outcome.slo_correction == pytest.approx(1.1)
    assert reasons(decision)["predicted"]["slo_code"] == "slo_unmeasured"


# -- safe defaults ----------------------------------------------------------------------------


def test_with_too_little_history_or_prediction_off_the_reactive_rules_size_it_and_say_so():
    lively = dict(delivered_slo_attainment=1.0, delivered_requests=5_000)
    young, outcome = decided(model(800.0, history_seconds=600.0, **lively))
    assert young.recommended_replicas == 10 and not outcome.predictive
    assert "10 of the 30 minutes of traffic" in reasons(young)["prediction_warming_up"]["message"]
    off, outcome = decided(model(800.0, prediction_enabled=False, **lively))
    assert off.recommended_replicas == 10 and not outcome.predictive
    assert "prediction_off" in reasons(off)
    # Off for a snapshot that does not predict at all: the reactive rules, no reason.
    plain, _ = decided(replace(model(800.0), prediction_enabled=None))
    assert "predicted" not in reasons(plain)
