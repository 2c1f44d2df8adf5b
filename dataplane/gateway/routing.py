"""Which replica serves a request: the one with the least outstanding MU (what this worker
has sent it and not yet seen finish), with optional affinity bounded by load.

Affinity (a session header, or a hash of the prompt's start) picks a replica by rendezvous
hashing, so the same session lands on the same replica while the set of replicas is stable
and only 1/N of the sessions move when one comes or goes. A pinned replica is used only while
its outstanding MU is within `load_factor` × the mean over the candidates (or it is idle): a
hot session cannot pin a replica beyond that, and spills to the least loaded one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from .contract import Replica


def _weight(affinity: str, endpoint: str) -> bytes:
    return hashlib.blake2b(f"{affinity}|{endpoint}".encode(), digest_size=8).digest()


class Router:
    def __init__(self, *, load_factor: float = 1.5):
        self.load_factor = load_factor
        self.outstanding_mu: dict[str, float] = {}
        self._turn = 0

    def pick(
        self,
        replicas: Sequence[Replica],
        *,
        affinity: str | None = None,
        exclude: Iterable[str] = (),
    ) -> Replica | None:
        excluded = set(exclude)
        candidates = [r for r in replicas if r.endpoint not in excluded]
        if not candidates:
            return None
        load = self.outstanding_mu
        if affinity:
            pinned = max(candidates, key=lambda r: _weight(affinity, r.endpoint))
            pinned_load = load.get(pinned.endpoint, 0.0)
            mean = sum(load.get(r.endpoint, 0.0) for r in candidates) / len(candidates)
            if pinned_load <= 0.0 or pinned_load <= self.load_factor * mean:
                return pinned
        # Least outstanding MU; ties go round the candidates so an idle fleet is spread.
        self._turn += 1
        n = len(candidates)
        best = min(
            range(n), key=lambda i: (load.get(candidates[i].endpoint, 0.0), (i - self._turn) % n)
        )
        return candidates[best]

    def add(self, endpoint: str, mu: float) -> None:
        self.outstanding_mu[endpoint] = self.outstanding_mu.get(endpoint, 0.0) + mu

    def done(self, endpoint: str, mu: float) -> None:
        left = self.outstanding_mu.get(endpoint, 0.0) - mu
        if left <= 1e-9:
            self.outstanding_mu.pop(endpoint, None)
        else:
            self.outstanding_mu[endpoint] = left
