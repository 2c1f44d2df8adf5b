"""The demand's trend: how fast a model's demand rises, for the cold-start lead of the policy.

The series is the model's demand per complete minute (served MU plus the refused requests'
estimated MU, all customers together), oldest first, over the last TREND_MINUTES; a minute
without traffic is 0. The trend is the least-squares slope through it, as MU/min gained per
second. One busy minute after quiet ones is a step, not a line to extend a cold start ahead
(the minute plan already covers it), so a trend needs traffic in at least TREND_MIN_BUSY_MINUTES.

Pure: the live snapshot and the fleet simulator's adapter compute it the same way.
"""

from collections.abc import Sequence

TREND_MINUTES = 5
TREND_MIN_BUSY_MINUTES = 3


def demand_trend_mu_per_minute_per_second(per_minute_mu: Sequence[float]) -> float:
    """The slope (MU/min gained per second) through the minutes given, oldest first."""
    points = list(per_minute_mu)
    if len(points) < 2 or sum(1 for mu in points if mu > 0) < TREND_MIN_BUSY_MINUTES:
        return 0.0
    n = len(points)
    mean_x = (n - 1) / 2
    mean_y = sum(points) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(points))
    variance = sum((x - mean_x) ** 2 for x in range(n))
    return covariance / variance / 60.0
