"""What gateways write back to the admission Redis for the control plane (docs/gateway-contract.md,
"What a gateway writes"): the requests they hold for a model that has no ready replica
(`gw:v1:waiting`; the allocation snapshot reads it as demand, so a model at zero wakes on the
requests waiting for it), their workers' heartbeats (`gw:v1:workers`, which the reaper reads)
and the usage they could not deliver yet (`gw:v1:spool`). Beside admission, whose Redis it is.
"""

from __future__ import annotations

import json
import logging

import redis

from capacity.admission.gate import buckets

logger = logging.getLogger(__name__)

WAITING = "gw:v1:waiting"
# field: a gateway worker's owner id; value: when it was last alive (ms since the epoch)
WORKERS = "gw:v1:workers"
SPOOL = "gw:v1:spool"
# A gateway refreshes its entry every second while requests wait; one not refreshed for this
# long belongs to a gateway that died with requests held, which wait no more.
WAITING_STALE_SECONDS = 10.0


def gateway_waiting(*, now_s: float) -> dict[str, tuple[float, float]]:
    """Model name → (MU of the requests the gateways hold for it now, seconds the oldest of them
    has waited: they arrived over that time); {} when Redis is down."""
    try:
        raw = buckets().client.hgetall(WAITING)
    except redis.RedisError as error:
        logger.warning("reading %s failed: %s", WAITING, error)
        return {}
    waiting: dict[str, tuple[float, float]] = {}
    for name, value in raw.items():
        try:
            entry = json.loads(value)
            requests = int(entry.get("requests", 0))
            mu = float(entry.get("mu", 0.0))
            updated_at = float(entry.get("updated_at", entry.get("since", 0.0)))
            since = float(entry.get("since", updated_at))
        except (ValueError, TypeError, AttributeError):
            continue
        if requests > 0 and mu >= 0 and now_s - updated_at <= WAITING_STALE_SECONDS:
            key = name.decode() if isinstance(name, bytes) else str(name)
            waiting[key] = (mu, max(0.0, now_s - since))
    return waiting
