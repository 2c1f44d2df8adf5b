"""Timing helpers: per-call latencies with perf_counter, medians over repeated rounds."""

import statistics
import time
from collections.abc import Callable


def _round(call: Callable[[], object], iterations: int) -> list[float]:
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def median_latencies(
    calls: dict[str, Callable[[], object]],
    *,
    iterations: int = 100,
    rounds: int = 5,
    warmup: int = 30,
) -> dict[str, float]:
    """Median seconds per call of each callable.

    The callables take turns round by round, so a slow spell of the machine hits all of them
    rather than only one; the median over every sample ignores the odd outlier (GC, scheduler).
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].extend(_round(call, iterations))
    return {name: statistics.median(values) for name, values in samples.items()}
