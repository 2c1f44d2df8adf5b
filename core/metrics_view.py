"""GET /metrics: the control plane's own Prometheus metrics (capacity.telemetry.metrics), and
gauges the apps compute from the database at each scrape (`scrape_time_collectors`).

Who may scrape (settings, METRICS_TOKEN): with a token set, whoever sends it as
`Authorization: Bearer <token>`; without one, the host itself (a loopback client address).
"""

import hmac
import ipaddress
import os

from django.conf import settings
from django.http import HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

from core.client_ip import client_ip

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


def _bearer_token(request) -> str:
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _refusal(request) -> HttpResponse | None:
    expected = settings.METRICS_TOKEN
    if expected:
        # Constant time: the comparison takes as long whatever prefix of the token a guess has.
        if hmac.compare_digest(_bearer_token(request).encode(), expected.encode()):
            return None
        refused = HttpResponse(
            "/metrics needs Authorization: Bearer <METRICS_TOKEN>.\n",
            status=401,
            content_type="text/plain",
        )
        refused["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return refused
    # The client address as the trusted proxies saw it: a proxy on this host connects from the
    # loopback, but the client it forwards is the address it appended, never the loopback.
    if _is_loopback(client_ip(request)):
        return None
    return HttpResponse(
        "/metrics answers this host only; set METRICS_TOKEN to let Prometheus scrape it.\n",
        status=403,
        content_type="text/plain",
    )


def metrics(request):
    """The metrics in Prometheus' text format, to the scrapers the settings allow."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    return HttpResponse(generate_latest(_Both(registry)), content_type=CONTENT_TYPE_LATEST)
