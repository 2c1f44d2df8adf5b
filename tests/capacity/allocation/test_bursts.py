"""Bursts: what a TTFT SLO needs from sub-minute bursts, beside the busiest minute."""

import pytest

from capacity.allocation.bursts import bursts


def test_steady_demand_needs_less_than_its_minute():
    # 10 MU every second: no sub-minute window needs more than the minute's 600 MU/min
    # (30 s of it over 30 + 2 s: 562.5).
    result = bursts([10.0] * 300, ttft_slo_seconds=2.0)
    assert result.busiest_minute_mu == pytest.approx(600)
    assert result.burst_mu_per_minute == pytest.approx(300 / 32 * 60)


def test_a_short_burst_needs_more_than_its_minute():
    # 5 seconds of 100 MU/s in an otherwise quiet 5 minutes: its minute holds 500 MU, but
    # starting all of it within 2 s of arrival needs 500 MU over 5 + 2 s.
    bins = [0.0] * 300
    bins[100:105] = [100.0] * 5
    result = bursts(bins, ttft_slo_seconds=2.0)
    assert result.burst_mu_per_minute == pytest.approx(500 / 7 * 60)
    assert result.busiest_minute_mu == pytest.approx(500)


def test_a_looser_slo_needs_less_and_no_traffic_needs_nothing():
    bins = [0.0] * 60
    bins[10] = 120.0
    assert bursts(bins, 10.0).burst_mu_per_minute < bursts(bins, 1.0).burst_mu_per_minute
    assert bursts([0.0] * 60, 2.0).burst_mu_per_minute == 0.0
    assert bursts([], 2.0).burst_mu_per_minute == 0.0
    with pytest.raises(ValueError):
        bursts(bins, -1.0)
