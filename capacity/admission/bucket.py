"""The one admission bucket rule: GCRA over MU, with partial spillover
(docs/design.md#admission). Pure: no Django, no Redis, no clock.

A bucket with rate `r` MU/min spends `T = 60,000 / r` ms per MU and keeps one number, its
theoretical arrival time (TAT, ms). A request of `c` MU is admitted by one bucket (`take`) when

    min(max(TAT, now) + c·T − burst, max(TAT, now)) ≤ now

that is, when it fits in the burst of rate ahead of time, or when the bucket is full (TAT ≤ now):
a request larger than the whole burst is admitted into debt, so a big request is slowed, never
refused forever. Over any interval t a bucket admits at most `r·t + burst` plus one request.
What a bucket can still take without debt, its remainder, is `(now + burst − max(TAT, now)) / T`.

A customer has two buckets per model, guaranteed (rate: its reservation) and best-effort (rate:
the tick's allowance), and `split` decides a request against both, in this order:

1. it fits the guaranteed remainder: all of it is guaranteed;
2. else it takes what is left of the guarantee (the remainder, possibly 0) and only the rest
   goes to the best-effort bucket (`take`); when that bucket takes the rest, the request is
   admitted split, its class best-effort (it is not wholly guaranteed, so it is scheduled and
   reported as best-effort) with its guaranteed part billed as guaranteed;
3. else, when the guaranteed bucket is full, all of it is guaranteed, into debt (the rule of
   `take`: a request larger than the whole burst is never refused forever);
4. else it is refused, and neither bucket changes. Its wait is the sooner of the times after
   which the guaranteed bucket takes it whole or the best-effort bucket takes the rest (both
   only grow with time, so either suffices; a split may fit a little earlier).

Three places decide with this rule and must agree (tests/capacity/admission/test_bucket_rule.py
feeds them one sequence): the Redis Lua script (capacity.admission.redis_buckets, the live
path; it cannot import Python, so it restates the rule in Lua), the fallback while Redis is down
(`LocalBuckets`, used by capacity.admission.gate) and the fleet simulator (simulation.engine).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

MS_PER_MINUTE = 60_000.0
# The live default of ADMISSION_BURST_SECONDS (controlplane/settings.py; a test keeps the two
# equal): what the simulator uses unless it is given the live setting.
DEFAULT_BURST_SECONDS = 10.0

GUARANTEED, BEST_EFFORT, REFUSED = "guaranteed", "best_effort", "refused"


@dataclass(frozen=True)
class Decision:
    admitted: bool
    tat_ms: float  # the bucket's TAT after the decision
    wait_ms: float  # refused: when the request would fit; admitted: 0; no rate: -1


def take(
    *, tat_ms: float | None, now_ms: float, cost_mu: float, mu_per_minute: float,
    burst_seconds: float,
) -> Decision:  # fmt: skip
    """Decide one request against a bucket whose TAT is `tat_ms` (None: never used, full)."""
    if not mu_per_minute > 0:
        return Decision(False, now_ms if tat_ms is None else tat_ms, -1.0)
    ms_per_mu = MS_PER_MINUTE / mu_per_minute
    tat = now_ms if tat_ms is None or tat_ms < now_ms else tat_ms
    new_tat = tat + cost_mu * ms_per_mu
    allow_at = min(new_tat - burst_seconds * 1000.0, tat)
    if allow_at <= now_ms:
        return Decision(True, new_tat, 0.0)
    return Decision(False, tat, allow_at - now_ms)


@dataclass(frozen=True)
class Split:
    """A request decided against a customer's guaranteed and best-effort buckets."""

    admission_class: str  # GUARANTEED, BEST_EFFORT (wholly or in part) or REFUSED
    guaranteed_mu: float  # the part taken from the guaranteed bucket
    best_effort_mu: float  # the part taken from the best-effort bucket
    guaranteed_tat_ms: float | None  # each bucket's TAT after the decision (None: untouched)
    best_effort_tat_ms: float | None
    wait_ms: float  # refused: when it would fit; admitted: 0; -1: never at these rates

    @property
    def admitted(self) -> bool:
        return self.admission_class != REFUSED


def split(
    *, guaranteed_tat_ms: float | None, best_effort_tat_ms: float | None, now_ms: float,
    cost_mu: float, guaranteed_mu_per_minute: float, best_effort_mu_per_minute: float,
    burst_seconds: float,
) -> Split:  # fmt: skip
    """Decide one request of `cost_mu` against both buckets (the module's rule, steps 1-4)."""
    burst_ms = burst_seconds * 1000.0
    g_rate = guaranteed_mu_per_minute
    left_mu = 0.0
    g_tat = now_ms
    ms_per_mu = 0.0
    if g_rate > 0:
        ms_per_mu = MS_PER_MINUTE / g_rate
        g_tat = guaranteed_tat_ms if guaranteed_tat_ms is not None else now_ms
        g_tat = max(g_tat, now_ms)
        whole_tat = g_tat + cost_mu * ms_per_mu
        if whole_tat - burst_ms <= now_ms:  # 1. it fits the guarantee
            return Split(GUARANTEED, cost_mu, 0.0, whole_tat, None, 0.0)
        left_mu = max(0.0, (now_ms + burst_ms - g_tat) / ms_per_mu)
    rest_mu = cost_mu - left_mu
    best_effort = take(
        tat_ms=best_effort_tat_ms, now_ms=now_ms, cost_mu=rest_mu,
        mu_per_minute=best_effort_mu_per_minute, burst_seconds=burst_seconds,
    )  # fmt: skip
    if best_effort.admitted:  # 2. the rest fits best-effort
        g_after = g_tat + left_mu * ms_per_mu if left_mu > 0 else None
        return Split(BEST_EFFORT, left_mu, rest_mu, g_after, best_effort.tat_ms, 0.0)
    if g_rate > 0 and g_tat <= now_ms:  # 3. a full guaranteed bucket takes it into debt
        return Split(GUARANTEED, cost_mu, 0.0, g_tat + cost_mu * ms_per_mu, None, 0.0)
    g_wait = -1.0  # 4. refused
    if g_rate > 0:
        g_wait = min(g_tat + cost_mu * ms_per_mu - burst_ms, g_tat) - now_ms
    return Split(REFUSED, 0.0, 0.0, None, None, _sooner(g_wait, best_effort.wait_ms))


def _sooner(a: float, b: float) -> float:
    """The sooner of two waits, -1 meaning never."""
    if a < 0:
        return b
    if b < 0:
        return a
    return min(a, b)


@dataclass(frozen=True)
class Floor:
    """A customer's reservation floor on a model: the MU/min its sold terms guarantee now, and
    the steps they already fix for later, `(from ms since the epoch, MU/min)` in time order (a
    reservation that starts or one that ends). The Redis script restates `at` (FLOOR_LUA)."""

    mu_per_minute: float
    steps: tuple[tuple[float, float], ...] = ()

    def at(self, now_ms: float) -> float:
        mu = self.mu_per_minute
        for from_ms, step_mu in self.steps:
            if from_ms > now_ms:
                break
            mu = step_mu
        return mu

    @property
    def ends_ms(self) -> float | None:
        """When the floor falls to nothing for good; None while a term is open-ended."""
        if not self.steps:
            return None if self.mu_per_minute > 0 else 0.0
        at_ms, mu = self.steps[-1]
        return None if mu > 0 else at_ms


def best_effort_now(
    mu_per_minute: float, *, tick_age_ms: float | None, fresh_ms: float, stale_ms: float
) -> float:
    """The tick's best-effort allowance as the tick's age allows (FLOOR_LUA restates it):
    whole while the tick is at most `fresh_ms` old, then falling linearly to nothing at
    `stale_ms`; nothing when no tick was ever seen (`tick_age_ms` None). The reservation floor
    never ages: a stalled tick takes slack away, never what was sold."""
    if not mu_per_minute > 0:
        return mu_per_minute
    if tick_age_ms is None:
        return 0.0
    if tick_age_ms <= fresh_ms:
        return mu_per_minute
    if tick_age_ms >= stale_ms:
        return 0.0
    return mu_per_minute * (stale_ms - tick_age_ms) / (stale_ms - fresh_ms)


class LocalBuckets:
    """Buckets kept in this process (the fallback while Redis is down): TATs by key, under
    `split`, thread-safe."""

    def __init__(self, *, burst_seconds: float) -> None:
        self.burst_seconds = burst_seconds
        self._tat_ms: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def split(
        self, guaranteed_key: Hashable, best_effort_key: Hashable, *, cost_mu: float,
        guaranteed_mu_per_minute: float, best_effort_mu_per_minute: float, now_ms: float,
    ) -> Split:  # fmt: skip
        with self._lock:
            decision = split(
                guaranteed_tat_ms=self._tat_ms.get(guaranteed_key),
                best_effort_tat_ms=self._tat_ms.get(best_effort_key),
                now_ms=now_ms,
                cost_mu=cost_mu,
                guaranteed_mu_per_minute=guaranteed_mu_per_minute,
                best_effort_mu_per_minute=best_effort_mu_per_minute,
                burst_seconds=self.burst_seconds,
            )
            if decision.guaranteed_tat_ms is not None:
                self._tat_ms[guaranteed_key] = decision.guaranteed_tat_ms
            if decision.best_effort_tat_ms is not None:
                self._tat_ms[best_effort_key] = decision.best_effort_tat_ms
            return decision

    def clear(self) -> None:
        with self._lock:
            self._tat_ms.clear()
