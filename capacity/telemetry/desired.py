"""`mu_desired_replicas{deployment, model}`: each deployment's latest target, read from the
database when /metrics is scraped.

Computed at scrape time, not set by the tick: every web process reports it (the tick runs in
a Celery worker, whose own registry nobody scrapes), and it never shows a value older than
the database's. A KEDA ScaledObject or an HPA on an external metric acts on it in the
Kubernetes actuator's `metric` mode (deploy/kubernetes/examples/).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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
