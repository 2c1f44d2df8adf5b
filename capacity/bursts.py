"""Sub-minute bursts as a rate: how much capacity a TTFT SLO needs for bursty arrivals.

A minute's average hides bursts: on Azure's code trace the busiest 5 seconds carry five times
the busiest minute's rate, and a TTFT SLO of a few seconds is broken by exactly those. If work
`A(W)` (MU) arrives within W seconds and every request of it must start within the SLO `d`,
a fleet serving `c` MU/s clears it in time only if `c · (W + d) ≥ A(W)` (the burst may queue
for the SLO but no longer). So the rate to plan for is the largest `A(W) / (W + d)` over the
window lengths W — for steady traffic the longest window wins and this is the busiest minute
again; for bursty traffic a short one wins.

`A(W)` is the busiest W seconds of MU by request start time (usage events' `started_at`) over
the lookback the caller gives, in 1-second bins.
"""

from collections.abc import Sequence

import numpy as np

BURST_WINDOWS_S = (1, 2, 5, 10, 15, 30, 60)


def burst_mu_per_minute(mu_per_second: Sequence[float], ttft_slo_seconds: float) -> float:
    """MU/min a fleet needs so that no window's arrivals wait longer than the SLO to start.

    `mu_per_second`: MU of the requests that started in each consecutive second (oldest first).
    """
    if ttft_slo_seconds < 0:
        raise ValueError(f"ttft_slo_seconds must be >= 0, got {ttft_slo_seconds}")
    bins = np.asarray(mu_per_second, dtype=float)
    if bins.size == 0:
        return 0.0
    cumulative = np.concatenate(([0.0], np.cumsum(bins)))
    best = 0.0
    for window_s in BURST_WINDOWS_S:
        width = min(window_s, bins.size)
        busiest = float(np.max(cumulative[width:] - cumulative[:-width]))
        best = max(best, busiest / (window_s + ttft_slo_seconds))
        if window_s >= bins.size:
            break
    return best * 60.0
