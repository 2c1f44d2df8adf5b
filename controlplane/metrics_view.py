"""GET /metrics: the control plane's own Prometheus metrics (capacity.telemetry.metrics), and
gauges the apps compute from the database at each scrape (`scrape_time_collectors`)."""

import os

from django.http import HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

# Collectors apps add in their AppConfig.ready() (controlplane cannot import them: the
# dependency order). They read the database when scraped, so every process answers the same.
scrape_time_collectors: list = []


class _Both:
    """A registry's metrics followed by the scrape-time collectors'."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()
        for collector in scrape_time_collectors:
            yield from collector.collect()


def metrics(request):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    return HttpResponse(generate_latest(_Both(registry)), content_type=CONTENT_TYPE_LATEST)
