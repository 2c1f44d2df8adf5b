"""Admission for the simulator: the live admission's two buckets per customer, under its rule.

The same shape as the live admission (docs/design.md#admission, capacity.admission.redis_buckets): a
request takes what is left of its customer's guaranteed bucket (rate: the reservation) and only
the rest from the customer's best-effort bucket (rate: the allowance the latest tick gave it),
else it is refused (partial spillover, `capacity.admission.bucket.split`). A request that
spilled over is best-effort, as the live admission classes it; `last_split` says how its MU
split. A refusal of a customer that holds a reservation is recorded as
`refused_guaranteed`, as the live script records it, so that refused demand is fed back by the
class it was refused in. Buckets refill continuously at their MU/min rate and hold
`burst_seconds` worth of it, under the one bucket rule of the live admission
(capacity.admission.bucket), which the simulator imports. The simulator knows each request's
size, so a request is charged its true MU (the live gateway estimates the output length and
reconciles later; the estimate is the gateway's business, not the rule's).

`set_rates` replaces the rates, as a tick rewrites the limits hash in Redis; the buckets' TATs
are kept, so a request admitted into debt stays in debt across ticks.

Reporting (`refusal_figures`): what a planner reads of admission in a simulation result, per
class of traffic. See its docstring for the definitions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from capacity.admission.bucket import DEFAULT_BURST_SECONDS, Split, split

from .traces import TraceRequest

# The classes the live admission answers and records (capacity.admission.redis_buckets).
GUARANTEED, BEST_EFFORT, REFUSED = "guaranteed", "best_effort", "refused"
REFUSED_GUARANTEED = "refused_guaranteed"
ADMITTED_CLASSES = frozenset({GUARANTEED, BEST_EFFORT})

# A request's admitted rate is judged over this trailing window (see refusal_figures).
RESERVATION_WINDOW_SECONDS = 60.0
SECONDS_PER_MINUTE = 60.0
MS_PER_SECOND = 1000.0


class Admission(Protocol):
    def decide(self, request: TraceRequest, mu: float, now_s: float) -> str:
        """The request's class: GUARANTEED, BEST_EFFORT, REFUSED or REFUSED_GUARANTEED; called
        once per request, in arrival order."""
        ...


@dataclass
class TokenBucketAdmission:
    """The live admission's buckets under the live rule (capacity.admission.bucket.split: GCRA
    with partial spillover, an oversized request admitted into debt when its guaranteed bucket
    is full), with the live burst.

    Rates are MU/min by client: `guaranteed_mu_per_minute` (the reservations) and
    `best_effort_mu_per_minute` (the allowances)."""

    guaranteed_mu_per_minute: dict[str, float] = field(default_factory=dict)
    best_effort_mu_per_minute: dict[str, float] = field(default_factory=dict)
    burst_seconds: float = DEFAULT_BURST_SECONDS
    # client -> the TAT (ms) of its guaranteed and of its best-effort bucket. Single-threaded,
    # so no lock (LocalBuckets has one for the live fallback); the rule itself is `split`.
    _guaranteed_tat_ms: dict[str, float] = field(init=False, repr=False, default_factory=dict)
    _best_effort_tat_ms: dict[str, float] = field(init=False, repr=False, default_factory=dict)
    # The last request's decision: its class and how its MU split between the buckets.
    last_split: Split | None = field(init=False, repr=False, default=None)

    def set_rates(
        self, *, guaranteed: Mapping[str, float], best_effort: Mapping[str, float]
    ) -> None:
        self.guaranteed_mu_per_minute = dict(guaranteed)
        self.best_effort_mu_per_minute = dict(best_effort)

    def decide(self, request: TraceRequest, mu: float, now_s: float) -> str:
        client = request.client
        guaranteed = self.guaranteed_mu_per_minute.get(client, 0.0)
        decision = split(
            guaranteed_tat_ms=self._guaranteed_tat_ms.get(client),
            best_effort_tat_ms=self._best_effort_tat_ms.get(client),
            now_ms=now_s * MS_PER_SECOND,
            cost_mu=mu,
            guaranteed_mu_per_minute=guaranteed,
            best_effort_mu_per_minute=self.best_effort_mu_per_minute.get(client, 0.0),
            burst_seconds=self.burst_seconds,
        )
        self.last_split = decision
        if decision.guaranteed_tat_ms is not None:
            self._guaranteed_tat_ms[client] = decision.guaranteed_tat_ms
        if decision.best_effort_tat_ms is not None:
            self._best_effort_tat_ms[client] = decision.best_effort_tat_ms
        if decision.admitted:
            return decision.admission_class
        return REFUSED_GUARANTEED if guaranteed > 0 else REFUSED

    def admit(self, request: TraceRequest, mu: float, now_s: float) -> bool:
        """True when the request is let in (either class)."""
        return self.decide(request, mu, now_s) in ADMITTED_CLASSES


def within_reservation(
    *,
    clients: Sequence[str],
    arrival_s: np.ndarray,
    mu: np.ndarray,
    admitted: np.ndarray,
    reservations_mu_per_minute: Mapping[str, float],
) -> np.ndarray:
    """Per request: its client holds a reservation and its admitted rate is within it, that is
    the MU admitted for the client over the RESERVATION_WINDOW before the request arrived, plus
    the request's own, is at most the reservation's MU over that window."""
    result = np.zeros(len(clients), dtype=bool)
    names = np.asarray(clients, dtype=object)
    for client, reserved_mu_per_minute in reservations_mu_per_minute.items():
        if reserved_mu_per_minute <= 0:
            continue
        mine = np.flatnonzero(names == client)
        if not len(mine):
            continue
        order = mine[np.argsort(arrival_s[mine], kind="stable")]
        times = arrival_s[order]
        taken = np.where(admitted[order], mu[order], 0.0)
        cumulative = np.concatenate(([0.0], np.cumsum(taken)))
        # Admitted MU strictly before each request, within the window.
        since = np.searchsorted(times, times - RESERVATION_WINDOW_SECONDS, side="right")
        before = np.searchsorted(times, times, side="left")
        window_mu = cumulative[before] - cumulative[since]
        allowed = reserved_mu_per_minute * RESERVATION_WINDOW_SECONDS / SECONDS_PER_MINUTE
        result[order] = window_mu + mu[order] <= allowed + 1e-9
    return result


def _share(part: np.ndarray, whole: np.ndarray) -> float:
    count = int(np.count_nonzero(whole))
    return float(np.count_nonzero(part & whole)) / count if count else float("nan")


@dataclass(frozen=True)
class RefusalFigures:
    refused_guaranteed_share: float
    refused_best_effort_share: float
    refused_within_reservation_share: float
    within_reservation_refused: int
    guaranteed_slo_attainment: float
    admitted_slo_attainment: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "refused_guaranteed_share": self.refused_guaranteed_share,
            "refused_best_effort_share": self.refused_best_effort_share,
            "refused_within_reservation_share": self.refused_within_reservation_share,
            "within_reservation_refused": self.within_reservation_refused,
            "guaranteed_slo_attainment": self.guaranteed_slo_attainment,
            "admitted_slo_attainment": self.admitted_slo_attainment,
        }


def refusal_figures(
    *,
    reserved: np.ndarray,
    refused: np.ndarray,
    admitted_guaranteed: np.ndarray,
    admitted: np.ndarray,
    within: np.ndarray,
    met_slo: np.ndarray,
) -> RefusalFigures:
    """Admission's figures over one set of requests (boolean arrays, one entry per request).

    - Guaranteed traffic is the requests of customers with a reservation, best-effort traffic
      the others' (the class a refusal is recorded in, as the live admission records it).
      `refused_guaranteed_share` and `refused_best_effort_share`: the share of each class's
      requests that were refused (NaN: no such traffic).
    - Within the reservation (`within_reservation`): a reserved customer's request while its
      admitted rate is within its reservation. `refused_within_reservation_share`: the share of
      those refused (the figure a reservation promises to keep at zero), and the count.
    - `guaranteed_slo_attainment`: of the requests admitted in the guaranteed class, the share
      whose first token came within the TTFT SLO (a request that timed out in a queue misses);
      `admitted_slo_attainment`: the same of every admitted request.
    """
    return RefusalFigures(
        refused_guaranteed_share=_share(refused, reserved),
        refused_best_effort_share=_share(refused, ~reserved),
        refused_within_reservation_share=_share(refused, within),
        within_reservation_refused=int(np.count_nonzero(refused & within)),
        guaranteed_slo_attainment=_share(met_slo, admitted_guaranteed),
        admitted_slo_attainment=_share(met_slo, admitted),
    )
