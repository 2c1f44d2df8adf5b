"""The allocation loop's gauges, read from the database when /metrics is scraped (registered
in CapacityConfig.ready with core.metrics_view): computed at scrape time, not set by the tick,
so every web process reports them (the tick runs in a Celery worker, whose own registry nobody
scrapes), even while the tick's own worker is stalled, and they never show a value older than
the database's.

- `mu_desired_replicas{deployment, model}` (and `mu_observed_spec_replicas`): each deployment's
  latest target. A KEDA ScaledObject or an HPA on an external metric acts on it in the
  Kubernetes actuator's `metric` mode (deploy/kubernetes/examples/).
- `controlplane_allocation_tick_age_seconds`: how long ago the tick last completed; absent
  before the first tick. Alert on it above ADMISSION_TICK_STALE_SECONDS.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from capacity.allocation.heartbeat import tick_state
from capacity.allocation.selectors import latest_decision_per_deployment


class DesiredReplicasCollector(Collector):
    def collect(self):
        desired = GaugeMetricFamily(
            "mu_desired_replicas",
            "The allocation tick's latest target replicas per deployment.",
            labels=["deployment", "model"],
        )
        observed = GaugeMetricFamily(
            "mu_observed_spec_replicas",
            "The replicas the workload itself was asked to run when the tick last read it "
            "(Kubernetes spec.replicas); absent where it cannot say.",
            labels=["deployment", "model"],
        )
        for decision in latest_decision_per_deployment():
            labels = [decision.deployment.name, decision.served_model.name]
            desired.add_metric(labels, decision.target_replicas)
            if decision.observed_spec_replicas is not None:
                observed.add_metric(labels, decision.observed_spec_replicas)
        yield desired
        yield observed


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
