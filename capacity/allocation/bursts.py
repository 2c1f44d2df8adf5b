"""Sub-minute bursts as a rate: how much capacity a TTFT SLO needs for bursty arrivals.

A minute's average hides bursts: on Azure's code trace the busiest 5 seconds carry five times
the busiest minute's rate, and a TTFT SLO of a few seconds is broken by exactly those. If work
`A(W)` (MU) arrives within W seconds and every request of it must start within the SLO `d`,
a fleet serving `c` MU/s clears it in time only if `c · (W + d) ≥ A(W)` (the burst may queue
for the SLO but no longer). So the rate a burst needs is the largest `A(W) / (W + d)` over
sub-minute windows W; it is a rate at full capacity (the queueing headroom is in it).

`A(W)` is the busiest W seconds of MU by request start time (usage events' `started_at`) over
the lookback the caller gives, in 1-second bins. The busiest minute of the same series comes
with it, so that the policy can tell traffic whose bursts bind (they need more than the minute
planned at the target utilisation) from traffic whose minute plan already absorbs them.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BURST_WINDOWS_S = (1, 2, 5, 10, 15, 30)
MINUTE_S = 60


@dataclass(frozen=True)
class Bursts:
    burst_mu_per_minute: float  # the rate that starts every burst within the SLO
    busiest_minute_mu: float  # the busiest 60 s of the same series (MU, i.e. MU/min)


def _busiest(cumulative: np.ndarray, window_s: int) -> float:
    width = min(window_s, len(cumulative) - 1)
    return float(np.max(cumulative[width:] - cumulative[:-width]))


def bursts(mu_per_second: Sequence[float], ttft_slo_seconds: float) -> Bursts:
    """`mu_per_second`: MU of the requests that started in each consecutive second (oldest
    first)."""
    if ttft_slo_seconds < 0:
        raise ValueError(f"ttft_slo_seconds must be >= 0, got {ttft_slo_seconds}")
    bins = np.asarray(mu_per_second, dtype=float)
    if bins.size == 0:
        return Bursts(0.0, 0.0)
    cumulative = np.concatenate(([0.0], np.cumsum(bins)))
    rate = max(_busiest(cumulative, w) / (w + ttft_slo_seconds) for w in BURST_WINDOWS_S)
    return Bursts(rate * 60.0, _busiest(cumulative, MINUTE_S))
