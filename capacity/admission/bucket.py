"""The one admission bucket rule: GCRA over MU (DESIGN §2). Pure: no Django, no Redis, no clock.

A bucket with rate `r` MU/min spends `T = 60,000 / r` ms per MU and keeps one number, its
theoretical arrival time (TAT, ms). A request of `c` MU is admitted when

    min(max(TAT, now) + c·T − burst, max(TAT, now)) ≤ now

that is, when it fits in the burst of rate ahead of time, or when the bucket is full (TAT ≤ now):
a request larger than the whole burst is admitted into debt, so a big request is slowed, never
refused forever. Over any interval t a bucket admits at most `r·t + burst` plus one request.

Three places decide with this rule and must agree (tests/capacity/admission/test_bucket_rule.py
feeds all three one sequence): the Redis Lua script (capacity.admission.redis_buckets, the live
path; it cannot import Python, so it restates the rule in Lua), the fallback while Redis is down
(`LocalBuckets` in capacity.admission.gate) and the fleet simulator (simulation.engine).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

MS_PER_MINUTE = 60_000.0
# The live default of ADMISSION_BURST_SECONDS (controlplane/settings.py; a test keeps the two
# equal): what the simulator uses unless it is given the live setting.
DEFAULT_BURST_SECONDS = 10.0


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


class LocalBuckets:
    """Buckets kept in this process (the fallback, the simulator): TATs by key, thread-safe."""

    def __init__(self, *, burst_seconds: float) -> None:
        self.burst_seconds = burst_seconds
        self._tat_ms: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def take(self, key: Hashable, *, cost_mu: float, mu_per_minute: float, now_ms: float) -> bool:
        with self._lock:
            decision = take(
                tat_ms=self._tat_ms.get(key),
                now_ms=now_ms,
                cost_mu=cost_mu,
                mu_per_minute=mu_per_minute,
                burst_seconds=self.burst_seconds,
            )
            if decision.admitted:
                self._tat_ms[key] = decision.tat_ms
            return decision.admitted

    def clear(self) -> None:
        with self._lock:
            self._tat_ms.clear()
