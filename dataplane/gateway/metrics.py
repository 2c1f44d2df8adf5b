"""The gateway's Prometheus metrics (`/metrics`).

With several worker processes, prometheus_client's multiprocess mode sums them
(`PROMETHEUS_MULTIPROC_DIR`, set by `python -m dataplane.gateway` before a worker starts).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as _multiprocess
from prometheus_client import values as _values

# In multiprocess mode every update of a value asks os.getpid() whether the process forked
# (so that a child writes its own file): a system call per update since glibc stopped caching
# the pid, several per request, about 6 % of a worker's CPU at 256 streams (py-spy). The pid
# is kept here instead, and a fork refreshes it in the child, which is all the check needs.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))
if "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ:
    # Before any metric below is made: each takes its value class when it is constructed.
    # (prometheus_client leaves MultiProcessValue unannotated.)
    _values.ValueClass = _values.MultiProcessValue(  # type: ignore[no-untyped-call]
        process_identifier=lambda: _pid[0]
    )

REQUESTS = Counter(
    "gateway_requests_total",
    "Requests by outcome (completed, cancelled, error, refused, rejected: a 4xx before "
    "admission) and admission class.",
    ["outcome", "admission_class"],
)
TTFT = Histogram(
    "gateway_time_to_first_token_seconds",
    "Streamed requests: from the request's arrival to the first byte of the engine's answer "
    "reaching the client (a non-streamed answer's first byte is its end: not observed).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
OVERHEAD = Histogram(
    "gateway_overhead_seconds",
    "Time the gateway adds before the engine sees the request: parsing, authentication, "
    "admission (one Redis round trip), routing.",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
)
INFLIGHT_MU = Gauge(
    "gateway_inflight_mu",
    "Estimated MU of the requests in flight, per replica (endpoint).",
    ["replica"],
    multiprocess_mode="livesum",
)
RETRIES = Counter("gateway_retries_total", "Requests retried on another replica.")
FALLBACK_DECISIONS = Counter(
    "gateway_admission_fallback_total",
    "Admission decisions made by a worker's own buckets while Redis could not be reached "
    "(each customer's share of its reservation; best-effort refused).",
)
USAGE_POSTED = Counter(
    "gateway_usage_events_total",
    "Usage events by where they went: accepted, duplicate, rejected, spooled.",
    ["result"],
)
PUBLICATIONS_REFUSED = Counter(
    "gateway_publications_refused_total",
    "Publications not taken (the last good copy kept): unsigned, a signature that no "
    "GATEWAY_PUBLICATION_KEYS key verifies, or older than the copy held (a replay).",
    ["reason"],
)
SPOOL_ENTRIES_DROPPED = Counter(
    "gateway_spool_entries_dropped_total",
    "gw:v1:spool entries dropped undelivered: not written by a gateway holding this "
    "service key (no or a wrong seal), so possibly forged.",
)
CONTRACT_VERSION = Gauge(
    "gateway_contract_version",
    "The version of the contract this worker serves from.",
    multiprocess_mode="max",
)
WAITING = Gauge(
    "gateway_waiting_requests",
    "Requests held for a model without a ready replica.",
    multiprocess_mode="livesum",
)


# Label children kept: `labels()` hashes its arguments and takes a lock on every call.
_REQUESTS_BY_LABELS: dict[tuple[str, str], Counter] = {}
_INFLIGHT_BY_REPLICA: dict[str, Gauge] = {}


def count_request(outcome: str, admission_class: str) -> None:
    """gateway_requests_total{outcome, admission_class} += 1."""
    child = _REQUESTS_BY_LABELS.get((outcome, admission_class))
    if child is None:
        child = REQUESTS.labels(outcome, admission_class)
        _REQUESTS_BY_LABELS[outcome, admission_class] = child
    child.inc()


def inflight_mu(endpoint: str) -> Gauge:
    """gateway_inflight_mu{replica}."""
    child = _INFLIGHT_BY_REPLICA.get(endpoint)
    if child is None:
        if len(_INFLIGHT_BY_REPLICA) > 4096:  # replicas come and go
            _INFLIGHT_BY_REPLICA.clear()
        child = _INFLIGHT_BY_REPLICA[endpoint] = INFLIGHT_MU.labels(endpoint)
    return child


def exposition() -> tuple[bytes, str]:
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        registry = CollectorRegistry()
        _multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
