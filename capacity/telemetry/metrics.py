"""The control plane's own metrics, served at /metrics (prometheus-client's default registry).

With several server processes (gunicorn workers), set PROMETHEUS_MULTIPROC_DIR to a directory
they share and /metrics aggregates them (prometheus-client's multiprocess mode); without it
each process answers for itself.
"""

from prometheus_client import Counter, Histogram

ADMISSIONS = Counter(
    "controlplane_admission_decisions",
    "Admission decisions, by class and outcome.",
    ["admission_class", "outcome"],
)
ADMISSION_DEGRADED = Counter(
    "controlplane_admission_degraded",
    "Admission decisions and reconciliations made without the Redis buckets.",
)
TICK_SECONDS = Histogram(
    "controlplane_allocation_tick_seconds",
    "Duration of allocation ticks.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ACTUATOR_FAILURES = Counter(
    "controlplane_actuator_failures",
    "Replica targets an actuator failed to apply, by actuator kind.",
    ["actuator"],
)
USAGE_EVENTS = Counter(
    "controlplane_usage_events",
    "Usage events received, by result.",
    ["result"],
)
HEALTH_PROBES = Counter(
    "controlplane_health_probes",
    "Inference probes of engine replicas, by outcome (skipped: real requests completed).",
    ["outcome"],
)
HEALTH_INCIDENTS = Counter(
    "controlplane_health_incidents",
    "Replicas marked unhealthy, by the cause of the last failed probe.",
    ["cause"],
)
HEALTH_SECONDS_TO_READY = Histogram(
    "controlplane_health_seconds_to_ready",
    "From marking a replica unhealthy to its first good probe after the restart.",
    buckets=(5, 10, 20, 30, 45, 60, 90, 120, 300, 600),
)
DEGRADATION_LEVEL_CHANGES = Counter(
    "controlplane_degradation_level_changes",
    "Degradation level changes, by direction.",
    ["direction"],
)
GATEWAY_PUBLICATIONS = Counter(
    "controlplane_gateway_publications",
    "Publications of the gateway documents to Redis (capacity.publication), by result.",
    ["result"],
)
CAPACITY_ALERTS = Counter(
    "controlplane_capacity_alerts",
    "Signed alerts of oversold capacity and guaranteed shortfall, by kind and delivery result.",
    ["kind", "result"],
)
