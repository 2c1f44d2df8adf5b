"""A gateway worker's heartbeat in `gw:v1:workers`: its name and when it last said it lives.

Every admission record names the worker that answers the request (`owner`). While the
worker's heartbeat is fresh, the control plane's reaper leaves the usage events of its requests
to it; a worker that dies stops beating, and once its heartbeat is older than
USAGE_REAP_GRACE_SECONDS the reaper closes its requests (capacity/metering/reaper.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .contract import WORKERS

log = logging.getLogger("dataplane.gateway")

# How often a worker refreshes its heartbeat (the reaper waits USAGE_REAP_GRACE_SECONDS,
# minutes, past the last one).
ALIVE_EVERY_SECONDS = 2.0


class Heartbeat:
    """One worker's name in admission records and its entry in gw:v1:workers."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.owner = "g" + os.urandom(8).hex()
        self._alive_at = 0.0

    @property
    def due(self) -> bool:
        """Whether the last beat is ALIVE_EVERY_SECONDS old."""
        return time.monotonic() - self._alive_at >= ALIVE_EVERY_SECONDS

    async def beat(self) -> None:
        """This worker's requests' usage events are still due from it, so the control plane's
        reaper waits for them (a Redis error is left to the next beat)."""
        try:
            # redis-py types its hash commands for the sync and the async client alike.
            await self.redis.hset(  # type: ignore[misc]
                WORKERS, self.owner, str(int(time.time() * 1000))
            )
            self._alive_at = time.monotonic()
        except (RedisError, OSError) as error:
            log.debug("gw:v1:workers not refreshed (%s)", error)

    async def leave(self) -> None:
        """Every event is handed over: nothing of this worker's is left for the reaper to wait
        for (a worker that dies without this is reaped once its heartbeat is old)."""
        with contextlib.suppress(RedisError, OSError):
            await self.redis.hdel(WORKERS, self.owner)  # type: ignore[misc]
