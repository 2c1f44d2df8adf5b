"""`controlplane_allocation_tick_age_seconds`: how long ago the allocation tick last
completed, read from the database when /metrics is scraped (as mu_desired_replicas is:
desired.py), so every web process reports it, even while the tick's own worker is stalled.
Absent before the first tick. Alert on it above ADMISSION_TICK_STALE_SECONDS."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from capacity.allocation.heartbeat import tick_state


class TickAgeCollector(Collector):
    def collect(self):
        age = GaugeMetricFamily(
            "controlplane_allocation_tick_age_seconds",
            "Seconds since the allocation tick last completed (stale above "
            "ADMISSION_TICK_STALE_SECONDS: best-effort allowances decay, reservations hold).",
        )
        state = tick_state()
        if state.age_seconds is not None:
            age.add_metric([], state.age_seconds)
        yield age
