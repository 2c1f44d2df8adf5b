"""Admission for the simulator: a guaranteed bucket per customer, then a shared best-effort one.

The same shape as the live admission (DESIGN.md §2): a request is charged its MU against the
customer's guaranteed bucket, else against the best-effort bucket, else refused. Buckets refill
continuously at their MU/min rate and hold `burst_seconds` worth of it, under the one bucket
rule of the live admission (capacity.admission.bucket), which the simulator imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from capacity.admission.bucket import DEFAULT_BURST_SECONDS, LocalBuckets

from .traces import TraceRequest


class Admission(Protocol):
    def admit(self, request: TraceRequest, mu: float, now_s: float) -> bool:
        """True to let the request in; called once per request, in arrival order."""
        ...


@dataclass
class TokenBucketAdmission:
    """The live admission's buckets under the live rule (capacity.admission.bucket: GCRA, an
    oversized request admitted into debt when its bucket is full), with the live burst."""

    guaranteed_mu_per_minute: dict[str, float] = field(default_factory=dict)
    best_effort_mu_per_minute: float = 0.0
    burst_seconds: float = DEFAULT_BURST_SECONDS
    _buckets: LocalBuckets = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._buckets = LocalBuckets(burst_seconds=self.burst_seconds)

    def admit(self, request: TraceRequest, mu: float, now_s: float) -> bool:
        now_ms = now_s * 1000.0
        rate = self.guaranteed_mu_per_minute.get(request.client, 0.0)
        if rate > 0 and self._buckets.take(
            ("guaranteed", request.client), cost_mu=mu, mu_per_minute=rate, now_ms=now_ms
        ):
            return True
        # One best-effort bucket for the fleet's spare capacity.
        return self.best_effort_mu_per_minute > 0 and self._buckets.take(
            ("best_effort",), cost_mu=mu, mu_per_minute=self.best_effort_mu_per_minute,
            now_ms=now_ms,
        )  # fmt: skip
