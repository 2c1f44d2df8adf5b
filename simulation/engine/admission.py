"""Admission for the simulator: a guaranteed bucket per customer, then a shared best-effort one.

The same shape as the live admission (DESIGN.md §2): a request is charged its MU against the
customer's guaranteed bucket, else against the best-effort bucket, else refused. Buckets refill
continuously at their MU/min rate and hold at most `burst_seconds` worth of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .traces import TraceRequest


class Admission(Protocol):
    def admit(self, request: TraceRequest, mu: float, now_s: float) -> bool:
        """True to let the request in; called once per request, in arrival order."""
        ...


@dataclass
class TokenBucketAdmission:
    guaranteed_mu_per_minute: dict[str, float] = field(default_factory=dict)
    best_effort_mu_per_minute: float = 0.0
    burst_seconds: float = 60.0
    # bucket key -> (level in MU, time of that level in s); None is the best-effort bucket.
    _buckets: dict[str | None, tuple[float, float]] = field(default_factory=dict, repr=False)

    def admit(self, request: TraceRequest, mu: float, now_s: float) -> bool:
        rate = self.guaranteed_mu_per_minute.get(request.client, 0.0)
        if rate > 0 and self._take(request.client, rate, mu, now_s):
            return True
        return self.best_effort_mu_per_minute > 0 and self._take(
            None, self.best_effort_mu_per_minute, mu, now_s
        )

    def _take(self, key: str | None, mu_per_minute: float, mu: float, now_s: float) -> bool:
        capacity_mu = mu_per_minute * self.burst_seconds / 60.0
        level_mu, since_s = self._buckets.get(key, (capacity_mu, now_s))
        level_mu = min(capacity_mu, level_mu + (now_s - since_s) * mu_per_minute / 60.0)
        taken = level_mu >= mu
        self._buckets[key] = (level_mu - mu if taken else level_mu, now_s)
        return taken
