"""The burst rate: what a TTFT SLO needs from sub-minute bursts."""

import pytest

from capacity.bursts import burst_mu_per_minute


def test_steady_demand_is_its_own_rate():
    # 10 MU every second: the longest window wins, 60 s of it over 60 + 2 s.
    rate = burst_mu_per_minute([10.0] * 300, ttft_slo_seconds=2.0)
    assert rate == pytest.approx(600 * 60 / 62)


def test_a_short_burst_is_planned_for_above_the_minute_average():
    # 5 seconds of 100 MU/s in an otherwise quiet 5 minutes: its minute averages 500 MU/min,
    # but starting all of it within 2 s of arrival needs 500 MU over 5 + 2 s.
    bins = [0.0] * 300
    bins[100:105] = [100.0] * 5
    rate = burst_mu_per_minute(bins, ttft_slo_seconds=2.0)
    assert rate == pytest.approx(500 / 7 * 60)
    assert rate > 500 * 60 / 62


def test_a_looser_slo_needs_less_and_no_traffic_needs_nothing():
    bins = [0.0] * 60
    bins[10] = 120.0
    assert burst_mu_per_minute(bins, 10.0) < burst_mu_per_minute(bins, 1.0)
    assert burst_mu_per_minute([0.0] * 60, 2.0) == 0.0
    assert burst_mu_per_minute([], 2.0) == 0.0
    with pytest.raises(ValueError):
        burst_mu_per_minute(bins, -1.0)
