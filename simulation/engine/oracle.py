"""The oracle: a lower bound on GPU-hours for serving a trace at the target utilisation.

It knows all future demand (`PolicyContext.future_requests`, which only it may read) and
precomputes, before the run, how many replicas it wants each second:

1. Demand. Each request's MU (`context.request_mu`) is put in the 1 s bin of its arrival; the MU/min
   demand at second t is the sum over the centred 60 s window [t - 30 s, t + 30 s). A centred
   window follows a ramp without lag in either direction, and 60 s matches the trace summary's
   peak (the busiest minute) and static-peak's sizing; a single request keeps one replica for
   the minute around it.
2. Need. need(t) = ceil(demand(t) / (replica MU/min × target utilisation)), capped at
   `max_replicas`, where a customer with a reservation counts at least its reservation (sold
   capacity is hot whether it is used or not, for static-peak and the live policy alike).
3. Cold starts. Starting a replica costs `cold_start_seconds` of GPU time before it serves, so
   keeping it through an idle gap is cheaper than releasing and restarting it whenever the gap
   is shorter than the cold start. The schedule is built layer by layer: the k-th replica is
   needed wherever need ≥ k; every gap between two such stretches that is shorter than the cold
   start is filled. The layers stay nested, so the filled count per second is the schedule.
   A gap before the first need or after the last is never filled.
4. Lead time. A replica must be asked for one cold start before it is needed, and a decision
   holds until the next tick, so `decide` at time t returns the largest scheduled count over
   [t, t + cold start + tick]: the current need, or what will be needed by the time a replica
   started now is ready, whichever is higher. Scale-down is never delayed.

The run starts with the replicas scheduled for the first cold start already warm (as
static-peak's are), since no policy could have started them within the trace.
"""

from __future__ import annotations

import math

import numpy as np

from .autoscaling import Observation
from .policy_context import PolicyContext

DEMAND_WINDOW_S = 60


def required_replicas(context: PolicyContext) -> np.ndarray:
    """need(t) per 1 s bin (steps 1-2 above), from 0 to past the last arrival."""
    requests = context.future_requests
    last_s = max((r.arrival_s for r in requests), default=0.0)
    bins = int(math.ceil(last_s)) + DEMAND_WINDOW_S + 1
    reservations = context.reservations_mu_per_minute
    # One series for everyone without a reservation, one per reserved customer.
    mu = {client: np.zeros(bins) for client in (None, *reservations)}
    for request in requests:
        series = mu[request.client if request.client in reservations else None]
        series[max(0, int(request.arrival_s))] += context.request_mu(request)
    half = DEMAND_WINDOW_S // 2
    index = np.arange(bins)
    lo = np.clip(index - half, 0, bins)
    hi = np.clip(index + DEMAND_WINDOW_S - half, 0, bins)
    demand_mu_per_minute = np.zeros(bins)
    for client, series in mu.items():
        cumulative = np.concatenate(([0.0], np.cumsum(series)))
        used = (cumulative[hi] - cumulative[lo]) * 60.0 / DEMAND_WINDOW_S
        # A reservation is sold capacity: hot whether or not it is used (as static-peak and
        # the live policy keep it).
        demand_mu_per_minute += used if client is None else np.maximum(used, reservations[client])
    capacity = context.replica_mu_per_minute * context.target_utilisation
    need = np.ceil(demand_mu_per_minute / capacity - 1e-9)
    need = np.where(demand_mu_per_minute > 0, np.maximum(need, 1), 0)
    return np.minimum(need, max(1, context.max_replicas)).astype(np.int64)


def fill_short_gaps(need: np.ndarray, max_gap_s: float) -> np.ndarray:
    """Step 3: per layer k, fill the gaps between stretches of need ≥ k shorter than max_gap_s."""
    schedule = np.zeros_like(need)
    for k in range(1, int(need.max(initial=0)) + 1):
        layer = need >= k
        on = np.flatnonzero(layer)
        if len(on) > 1:
            gaps = np.diff(on) - 1  # idle seconds between consecutive on-seconds
            for position in np.flatnonzero((gaps > 0) & (gaps < max_gap_s)):
                layer[on[position] + 1 : on[position + 1]] = True
        schedule += layer
    return schedule


class ScheduleAutoscaler:
    """A fleet that follows a per-second replica schedule known in advance (step 4 above): at
    each tick, the largest count over the next cold start and tick; the run starts with the
    replicas scheduled within the first cold start already warm."""

    def __init__(self, schedule: np.ndarray, *, cold_start_s: float, tick_s: float):
        self.schedule = schedule
        self.cold_start_s = cold_start_s
        self.lead_s = int(math.ceil(cold_start_s + tick_s))

    def _max_over(self, start_s: float, end_s: float) -> int:
        lo = max(0, int(math.floor(start_s)))
        hi = min(len(self.schedule), int(math.ceil(end_s)) + 1)
        return int(self.schedule[lo:hi].max()) if hi > lo else 0

    def initial_replicas(self) -> int:
        return self._max_over(0.0, self.cold_start_s)

    def decide(self, observation: Observation) -> int:
        now_s = observation.timestamp_s
        return self._max_over(now_s, now_s + self.lead_s)

    def asked_replica_seconds(self, from_s: float, until_s: float, tick_s: float) -> float:
        """Replica-seconds asked for at the ticks (multiples of `tick_s`) in [from_s, until_s):
        a floor on what a run of it holds from `from_s` on, when `until_s` is no later than the
        run's last arrival (a run holds at least what it asked for until the next tick, and
        what drains too, and goes on until every request is done)."""
        first = int(math.ceil(from_s / tick_s - 1e-9))
        last = int(math.ceil(until_s / tick_s - 1e-9))
        return tick_s * sum(
            self._max_over(t * tick_s, t * tick_s + self.lead_s) for t in range(first, last)
        )


class OracleAutoscaler(ScheduleAutoscaler):
    """The cheapest schedule that knows the future (see the module docstring)."""

    def __init__(self, context: PolicyContext):
        self.required = required_replicas(context)
        super().__init__(
            fill_short_gaps(self.required, context.cold_start_seconds),
            cold_start_s=context.cold_start_seconds,
            tick_s=context.tick_seconds,
        )
