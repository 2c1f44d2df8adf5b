"""The demand's trend (pure): the slope the cold-start lead projects, the same for the live
snapshot and the simulator."""

import pytest

from capacity.allocation.trend import demand_trend_mu_per_minute_per_second as trend


def test_a_steady_rise_is_its_slope_per_second():
    # +60 MU/min every minute is +1 MU/min every second.
    assert trend([100, 160, 220, 280, 340]) == pytest.approx(1.0)


def test_flat_and_falling_demand():
    assert trend([200, 200, 200, 200, 200]) == pytest.approx(0.0)
    assert trend([340, 280, 220, 160, 100]) == pytest.approx(-1.0)


def test_one_busy_minute_after_quiet_ones_is_a_step_not_a_trend():
    assert trend([0, 0, 0, 0, 500]) == 0.0
    assert trend([0, 0, 100, 300, 500]) > 0
