"""Baseline autoscalers the Model-Unit policy is compared against (all built from a
`PolicyContext`, none reads `future_requests`).

static-peak
    Enough replicas for the trace's peak 1-minute rate at the target utilisation (and for the
    sum of the reservations, if larger), always on.
kpa
    Knative's Pod Autoscaler on concurrency (running + waiting requests, as observed each tick):
    a target of 70 % of a replica's batch limit (`max_num_seqs`) per replica, averaged over a
    60 s stable window and a 6 s panic window. Panic mode starts when the panic window's
    concurrency exceeds twice the target for the replicas in service (at least one) and lasts
    until the condition has not held for a stable window; in panic the fleet never shrinks.
    The fleet goes to zero once no request has been seen (in flight, queued or arriving) for
    30 s, unless the context asks to keep a replica warm. The windows average the observations
    whose timestamps fall in them; with 15 s ticks the panic window holds the latest one only.
hpa-rps
    Kubernetes' HPA on requests per second per replica: the target is the replica's saturated
    throughput at the target utilisation for the trace's mean request,
    `replica_mu_per_minute × target_utilisation / 60 / mean_request_mu` req/s. Scale-up is
    immediate; scale-down is stabilised: the fleet is the largest recommendation of the last
    300 s. Like the HPA it never goes below one replica (no scale to zero); the HPA's 10 %
    tolerance is left out.
"""

from __future__ import annotations

import math
from collections import deque

from .autoscaling import Observation
from .policy_context import PolicyContext

KPA_TARGET_SHARE = 0.7
KPA_STABLE_WINDOW_S = 60.0
KPA_PANIC_WINDOW_S = 6.0
KPA_PANIC_THRESHOLD = 2.0
KPA_SCALE_TO_ZERO_AFTER_S = 30.0
HPA_STABILISATION_S = 300.0


def replicas_for(mu_per_minute: float, context: PolicyContext) -> int:
    """Replicas that serve `mu_per_minute` at the target utilisation (0 for no demand)."""
    if mu_per_minute <= 0:
        return 0
    capacity = context.replica_mu_per_minute * context.target_utilisation
    # A hair of tolerance so that exactly n replicas' worth is n, not n + 1.
    return max(1, math.ceil(mu_per_minute / capacity - 1e-9))


def static_peak_replicas(context: PolicyContext) -> int:
    """Replicas for the trace's peak minute or the reservations, whichever is more (one at
    least with keep-warm)."""
    peak_mu_per_minute = context.peak_rate_req_per_s * 60.0 * context.mean_request_mu
    reserved = sum(context.reservations_mu_per_minute.values())
    replicas = replicas_for(max(peak_mu_per_minute, reserved), context)
    return max(replicas, 1 if context.keep_warm else 0)


class StaticPeakAutoscaler:
    """Replicas for the trace's peak, always on."""

    def __init__(self, context: PolicyContext):
        self.replicas = static_peak_replicas(context)

    def initial_replicas(self) -> int:
        return self.replicas

    def decide(self, observation: Observation) -> int:
        return self.replicas


class KPAAutoscaler:
    """Knative-style concurrency autoscaler (see the module docstring)."""

    def __init__(self, context: PolicyContext):
        self.target = max(1e-9, KPA_TARGET_SHARE * context.max_num_seqs)
        self.max_replicas = context.max_replicas
        self.min_replicas = 1 if context.keep_warm else 0
        self.warm_replicas = min(self.max_replicas, context.warm_replicas)
        self.history: deque[tuple[float, int]] = deque()  # (timestamp, concurrency)
        self.last_activity_s: float | None = None
        self.panic_until_s = -math.inf
        self.replicas = 0

    def initial_replicas(self) -> int:
        return max(self.min_replicas, self.warm_replicas)

    def _average(self, now_s: float, window_s: float) -> float:
        values = [c for t, c in self.history if t > now_s - window_s]
        return sum(values) / len(values) if values else 0.0

    def decide(self, observation: Observation) -> int:
        now_s = observation.timestamp_s
        concurrency = observation.running_requests + observation.waiting_requests
        self.history.append((now_s, concurrency))
        while self.history and self.history[0][0] <= now_s - KPA_STABLE_WINDOW_S:
            self.history.popleft()
        if concurrency or observation.arrived_requests:
            self.last_activity_s = now_s

        in_service = max(1, observation.current_replicas)
        stable = math.ceil(self._average(now_s, KPA_STABLE_WINDOW_S) / self.target - 1e-9)
        panic_concurrency = self._average(now_s, KPA_PANIC_WINDOW_S)
        panic = math.ceil(panic_concurrency / self.target - 1e-9)
        if panic_concurrency > KPA_PANIC_THRESHOLD * self.target * in_service:
            self.panic_until_s = now_s + KPA_STABLE_WINDOW_S
        if now_s < self.panic_until_s:
            desired = max(panic, stable, observation.current_replicas)
        else:
            desired = stable
        idle = (
            self.last_activity_s is None
            or now_s - self.last_activity_s >= KPA_SCALE_TO_ZERO_AFTER_S
        )
        desired = max(desired, self.min_replicas, 0 if idle else 1)
        self.replicas = min(self.max_replicas, desired)
        return self.replicas


class HPARpsAutoscaler:
    """Kubernetes HPA on requests/s per replica with a 300 s scale-down stabilisation."""

    def __init__(self, context: PolicyContext):
        mean_mu = context.mean_request_mu
        if mean_mu > 0:
            self.target_rps = (
                context.replica_mu_per_minute * context.target_utilisation / 60.0 / mean_mu
            )
        else:
            self.target_rps = math.inf
        self.max_replicas = max(1, context.max_replicas)
        self.warm_replicas = min(self.max_replicas, max(1, context.warm_replicas))
        self.recommendations: deque[tuple[float, int]] = deque()

    def initial_replicas(self) -> int:
        return self.warm_replicas

    def decide(self, observation: Observation) -> int:
        now_s = observation.timestamp_s
        rate = observation.arrived_requests / observation.window_s if observation.window_s else 0
        recommendation = min(self.max_replicas, max(1, math.ceil(rate / self.target_rps - 1e-9)))
        self.recommendations.append((now_s, recommendation))
        while self.recommendations and self.recommendations[0][0] < now_s - HPA_STABILISATION_S:
            self.recommendations.popleft()
        return max(r for _, r in self.recommendations)
