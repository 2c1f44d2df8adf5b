"""`mu_oversold_mu_per_minute{model}` and `mu_guaranteed_shortfall_mu_per_minute{model}`: sold
capacity the fleet cannot serve, and sold capacity the allocation tick cannot make hot, read
from the database (capacity.models.CapacityRisk) when /metrics is scraped.

Read at scrape time, as `mu_desired_replicas` is (desired.py): every web process answers the
same, with what the last re-check (a catalogue or pricing change, or a tick) stored. Every
served model has both series, 0 while it is fine, so an alert rule needs no `absent()`.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from capacity.models import ServedModel


class OversoldCollector(Collector):
    def collect(self):
        oversold = GaugeMetricFamily(
            "mu_oversold_mu_per_minute",
            "Sold MU/min the fleet's GPUs cannot serve at the worst moment from now (0: all "
            "sold capacity is feasible).",
            labels=["model"],
        )
        short = GaugeMetricFamily(
            "mu_guaranteed_shortfall_mu_per_minute",
            "Sold MU/min the allocation tick could not make hot at its last tick.",
            labels=["model"],
        )
        rows = ServedModel.objects.values_list(
            "name",
            "capacity_risk__oversold_mu_per_minute",
            "capacity_risk__guaranteed_shortfall_mu_per_minute",
        ).order_by("name")
        for name, oversold_mu, short_mu in rows:
            oversold.add_metric([name], oversold_mu or 0.0)
            short.add_metric([name], short_mu or 0.0)
        yield oversold
        yield short
