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
