"""Holding requests for a model at zero until a replica is published (a cold start).

A request for a model without a ready replica waits, as Knative's activator makes it wait, up
to GATEWAY_COLD_START_WAIT_SECONDS. Meanwhile its demand is counted in `gw:v1:waiting` (one
script keeps the count consistent across workers and gateways), which the control plane's tick
reads as a reason to start a replica, and the control plane is asked for a tick now
(`POST /api/v1/allocation/wake`, at most once a second per model per worker) rather than at
its next scheduled one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .contract import WAITING, ContractReader, Model
from .metrics import WAITING as WAITING_GAUGE
from .settings import Settings

log = logging.getLogger("dataplane.gateway")

WAKE_PATH = "/api/v1/allocation/wake"
WAKE_EVERY_SECONDS = 1.0

# Waiting demand for a model at zero, kept consistent across workers and gateways by one script.
# KEYS[1] gw:v1:waiting; ARGV: model, requests delta, MU delta, now
_WAITING_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local now = tonumber(ARGV[4])
local w
if raw then w = cjson.decode(raw) else w = {requests = 0, mu = 0, since = now} end
w.requests = w.requests + tonumber(ARGV[2])
w.mu = w.mu + tonumber(ARGV[3])
if w.requests <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 0
end
if w.mu < 0 then w.mu = 0 end
w.updated_at = now
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(w))
return w.requests
"""


class Holding:
    """The holds of one worker: the waiting demand it adds, and the wake-ups it asks for."""

    def __init__(self, redis: aioredis.Redis, reader: ContractReader, settings: Settings) -> None:
        self.reader = reader
        self.settings = settings
        self._waiting_script = redis.register_script(_WAITING_LUA)
        # The control plane's wake endpoint (not the hot path): aiohttp's client.
        self.session: aiohttp.ClientSession | None = None
        # model -> when this worker last asked the control plane for a tick (at most 1/s).
        self._woken_at: dict[str, float] = {}
        self._wakes: set[asyncio.Task[None]] = set()

    def open(self) -> None:
        self.session = aiohttp.ClientSession(trust_env=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def wait_for_replica(self, model: Model, mu: float, deadline: float) -> Model:
        """Hold a request for a model without a ready replica until one is published (or the
        deadline), recording the waiting demand in `gw:v1:waiting` and asking the control plane
        for a tick now (`POST /api/v1/allocation/wake`, at most once a second per model)."""
        await self._waiting(model.name, 1, mu)
        self._wake(model.name)
        WAITING_GAUGE.inc()
        try:
            touched = time.monotonic()
            while (left := deadline - time.monotonic()) > 0:
                await self.reader.changed(min(left, 1.0))
                current = self.reader.contract.models.get(model.name)
                if current is not None and current.replicas:
                    return current
                if time.monotonic() - touched >= 1.0:
                    touched = time.monotonic()
                    await self._waiting(model.name, 0, 0.0)
                    self._wake(model.name)
            return self.reader.contract.models.get(model.name) or model
        finally:
            WAITING_GAUGE.dec()
            await asyncio.shield(self._waiting(model.name, -1, -mu))

    def _wake(self, model: str) -> None:
        """Ask the control plane for a tick now (fire and forget; its next scheduled tick
        reads the waiting demand anyway)."""
        if not self.settings.control_plane_url:  # no control plane to ask
            return
        now = time.monotonic()
        if now - self._woken_at.get(model, -WAKE_EVERY_SECONDS) < WAKE_EVERY_SECONDS:
            return
        self._woken_at[model] = now
        task = asyncio.create_task(self._post_wake(model))
        self._wakes.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._wakes.discard)

    async def _post_wake(self, model: str) -> None:
        if self.session is None:
            return
        url = self.settings.control_plane_url.rstrip("/") + WAKE_PATH
        try:
            async with self.session.post(
                url,
                json={"model": model},
                headers={"Authorization": f"Bearer {self.settings.service_key}"},
                timeout=aiohttp.ClientTimeout(total=self.settings.usage_timeout_seconds),
            ) as answer:
                if answer.status >= 400:
                    log.warning("wake for %s: the control plane answered %s", model, answer.status)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            log.warning("wake for %s: the control plane could not be reached (%s)", model, error)

    async def _waiting(self, model: str, requests: int, mu: float) -> None:
        try:
            await self._waiting_script(
                keys=[WAITING], args=[model, requests, repr(float(mu)), repr(time.time())]
            )
        except (RedisError, OSError) as error:
            log.warning("gw:v1:waiting not updated (%s)", error)
