"""Usage events: one per request, posted in batches (at most GATEWAY_USAGE_BATCH_MAX, or every
GATEWAY_USAGE_FLUSH_SECONDS) to the control plane's `POST /api/v1/usage/events` with the
service key GATEWAY_SERVICE_KEY. A batch that cannot be delivered (the control plane down, a
5xx, a 429) is appended to the Redis stream `gw:v1:spool`, sealed with this service key, and
redelivered later, oldest first; an entry without a valid seal is dropped, never posted.
Ingestion is idempotent on (customer, event_id), so redelivery never double-counts. While
Redis is down too, undelivered events wait in memory (bounded).

The fields added to the event schema over time (`OPTIONAL_FIELDS`: `estimated_mu` of refused
events, `held_ms`, `streamed`, `fallback_class`, `prompts`, `sequences`, `engine_status`) are
sent while the control plane accepts them:
a control plane whose schema does not know one rejects it by name (an older one, mid-rollout),
and the gateway then sends those events again without it, and stops sending it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from capacity.admission.redis_layout import BEST_EFFORT, GUARANTEED

from .contract import SPOOL
from .metrics import SPOOL_ENTRIES_DROPPED, USAGE_POSTED, count_request

log = logging.getLogger("dataplane.gateway")

# Newer than the first event schema: dropped, and no longer sent, once the control plane
# rejects them by name.
OPTIONAL_FIELDS = (
    "estimated_mu",
    "held_ms",
    "streamed",
    "fallback_class",
    "prompts",
    "sequences",
    "engine_status",
)
MEMORY_LIMIT_EVENTS = 200_000
REDELIVERY_BATCHES = 20  # spooled batches a redelivery posts before giving way
USAGE_PATH = "/api/v1/usage/events"


class UsageSink:
    def __init__(
        self,
        *,
        redis_client: aioredis.Redis,
        control_plane_url: str,
        service_key: str,
        batch_max: int,
        flush_seconds: float,
        spool_retry_seconds: float,
        timeout_seconds: float,
    ):
        self.redis = redis_client
        self.url = control_plane_url.rstrip("/") + USAGE_PATH if control_plane_url else ""
        self.service_key = service_key
        self.batch_max = batch_max
        self.flush_seconds = flush_seconds
        self.spool_retry_seconds = spool_retry_seconds
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self.unknown_fields: set[str] = set()  # OPTIONAL_FIELDS the control plane refused
        self._buffer: list[dict[str, Any]] = []
        self._unspooled: deque[list[dict[str, Any]]] = deque()  # Redis down as well
        self._full = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        # Spool entries are sealed with an HMAC under a key derived from the service key:
        # Redis write access alone cannot add an event that this gateway would then post (and
        # the control plane bill) under its key. `sealer` names the key, not revealing it, so
        # gateways with other service keys leave each other's entries alone.
        seal_key = hmac.new(service_key.encode(), b"gw:v1:spool seal", hashlib.sha256).digest()
        self._seal_key = seal_key
        self._sealer = hmac.new(seal_key, b"sealer", hashlib.sha256).hexdigest()[:16]

    def record(self, usage: Usage) -> None:
        """Take the request's one usage event (at most once), and count the request."""
        if usage.recorded:
            return
        usage.recorded = True
        self.add(usage.event(time.time()))
        count_request(usage.outcome, usage.admission_class or "none")

    def add(self, event: dict[str, Any]) -> None:
        self._buffer.append(event)
        if len(self._buffer) >= self.batch_max:
            self._full.set()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(trust_env=False)

    async def close(self) -> None:
        await self.flush()
        if self._session is not None:
            await self._session.close()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_redelivery = loop.time() + self.spool_retry_seconds
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.flush_seconds)
            self._full.clear()
            try:
                await self.flush()
                if loop.time() >= next_redelivery:
                    next_redelivery = loop.time() + self.spool_retry_seconds
                    await self.redeliver()
            except Exception:  # the loop must outlive any one failure
                log.exception("usage delivery failed; retrying")

    async def flush(self) -> None:
        async with self._lock:
            while self._buffer:
                batch = self._buffer[: self.batch_max]
                del self._buffer[: self.batch_max]
                if not await self._post(batch):
                    await self._spool(batch)

    async def _spool(self, batch: list[dict[str, Any]]) -> None:
        events = json.dumps(batch).encode()
        try:
            await self.redis.xadd(
                SPOOL, {"events": events, "sealer": self._sealer, "seal": self._seal(events)}
            )
            USAGE_POSTED.labels("spooled").inc(len(batch))
            log.warning("usage: %d events spooled to %s", len(batch), SPOOL)
        except (RedisError, OSError):
            self._unspooled.append(batch)
            while sum(len(b) for b in self._unspooled) > MEMORY_LIMIT_EVENTS:
                lost = self._unspooled.popleft()
                log.error("usage: %d events lost (Redis and the control plane down)", len(lost))

    async def redeliver(self) -> None:
        """Spooled batches, oldest first, until one fails again."""
        async with self._lock:
            while self._unspooled:
                if not await self._post(self._unspooled[0]):
                    await self._spool(self._unspooled.popleft())
                    return
                self._unspooled.popleft()
            # Oldest first, paging past the entries of gateways with another service key
            # (theirs to deliver), at most REDELIVERY_BATCHES of this gateway's at a time.
            start: str = "-"
            delivered = 0
            while delivered < REDELIVERY_BATCHES:
                try:
                    entries = await self.redis.xrange(SPOOL, min=start, count=20)
                except (RedisError, OSError):
                    return
                if not entries:
                    return
                for entry_id, fields in entries:
                    start = "(" + _text(entry_id)
                    fields = {_text(k): v for k, v in fields.items()}
                    sealer = fields.get("sealer")
                    if sealer is not None and _text(sealer) != self._sealer:
                        continue
                    raw = fields.get("events") or b""
                    raw = raw if isinstance(raw, bytes) else raw.encode()
                    if sealer is None or not hmac.compare_digest(
                        _text(fields.get("seal") or b""), self._seal(raw)
                    ):
                        # Written by someone without this service key: a party that can
                        # write the stream but is not a gateway. Posted, it would be billed
                        # under this gateway's key.
                        SPOOL_ENTRIES_DROPPED.inc()
                        log.error("usage: spool entry %s has no valid seal; dropped", entry_id)
                    else:
                        try:
                            batch = json.loads(raw) if raw else []
                        except ValueError:
                            batch = []
                        if batch and not await self._post(batch):
                            return
                        delivered += 1
                    try:
                        await self.redis.xdel(SPOOL, entry_id)
                    except (RedisError, OSError):
                        return

    async def _post(self, batch: list[dict[str, Any]]) -> bool:
        """True when the control plane took the batch (accepted, duplicate or rejected for
        good); False when it should be tried again later."""
        if not self.url or self._session is None:
            return False
        if self.unknown_fields:
            batch = [_without(e, self.unknown_fields) for e in batch]
        try:
            async with self._session.post(
                self.url,
                json={"events": batch},
                headers={"Authorization": f"Bearer {self.service_key}"},
                timeout=self.timeout,
            ) as response:
                status = response.status
                body = await response.json(content_type=None) if status < 500 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.warning("usage: the control plane could not be reached (%s)", error)
            return False
        if status not in (200, 207, 400) or not isinstance(body, dict):
            log.warning("usage: the control plane answered %s", status)
            return False
        USAGE_POSTED.labels("accepted").inc(len(body.get("accepted") or ()))
        USAGE_POSTED.labels("duplicate").inc(len(body.get("duplicates") or ()))
        rejected = body.get("rejected") or []
        again = []
        for item in rejected:
            reasons = [str(r) for r in item.get("reasons") or ()]
            index = item.get("index")
            # "held_ms: is not a field of a usage event": a control plane older than the field.
            unknown = {
                name
                for name in OPTIONAL_FIELDS
                for reason in reasons
                if reason.startswith(f"{name}:") and "not a field" in reason
            }
            if unknown and isinstance(index, int) and 0 <= index < len(batch):
                self.unknown_fields |= unknown
                again.append(_without(batch[index], self.unknown_fields))
            else:
                USAGE_POSTED.labels("rejected").inc()
                log.error(
                    "usage: event %s rejected: %s", item.get("event_id", index), " ".join(reasons)
                )
        if again:
            log.warning(
                "usage: the control plane does not take %s; sent without",
                ", ".join(sorted(self.unknown_fields)),
            )
            if not await self._post(again):
                await self._spool(again)
        return True

    def _seal(self, events: bytes) -> str:
        return hmac.new(self._seal_key, events, hashlib.sha256).hexdigest()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _without(event: dict[str, Any], names: set[str]) -> dict[str, Any]:
    if not names.intersection(event):
        return event
    return {k: v for k, v in event.items() if k not in names}


@dataclass
class Usage:
    """What becomes the request's one usage event."""

    request_id: str
    customer: str
    model: str
    started_at: float
    input_tokens: int
    estimated_mu: float
    admission_class: str | None = None
    outcome: str = "error"
    deployment: str | None = None
    replica: str | None = None  # the endpoint that served it
    cached_input_tokens: int = 0
    output_tokens: int = 0
    images: int = 0
    ttft_ms: float | None = None
    # How long the request was held for a model at zero (its cold start), kept apart from its
    # TTFT, which counts from the end of the hold; None: not held.
    held_ms: float | None = None
    streamed: bool | None = None
    # A list of prompts is that many engine requests, `n` sequences each: its usage (the
    # engine's totals) is priced as that work, and may exceed one context.
    prompts: int = 1
    sequences: int = 1
    # The engine's status when it refused the request before any work (a 4xx): billed 0 MU.
    engine_status: int | None = None
    engine_usage: bool = False
    # The prompt's text in bytes (None for prompts given as token ids): sent beside the
    # engine's own input token count, it calibrates the model's bytes per token.
    prompt_bytes: int | None = None
    # What request limits count: the input and the most it may generate (tokens per minute),
    # and the customer key it came with (its own limits); whether it holds a slot in flight.
    limit_tokens: int = 0
    customer_id: int = 0
    api_key_prefix: str | None = None
    holds_slot: bool = False
    # Decided by this worker while Redis could not be reached ("guaranteed", or
    # "refused_guaranteed" / "refused" for a refusal with or without a reservation): sent with
    # the event, so ingestion bills it by what was decided (verification "fallback").
    fallback_class: str | None = None
    # Its one event was handed to the sink (exactly one per request, whatever stage it ends in).
    recorded: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def take_engine_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            self.input_tokens = prompt
            self.output_tokens = completion
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self.cached_input_tokens = cached if isinstance(cached, int) else 0
            self.engine_usage = True

    def event(self, finished_at: float) -> dict[str, Any]:
        event: dict[str, Any] = {
            "event_id": self.request_id,
            "customer": self.customer,
            "model": self.model,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(max(finished_at, self.started_at)),
            "input_tokens": max(0, self.input_tokens),
            "cached_input_tokens": min(max(0, self.cached_input_tokens), self.input_tokens),
            "output_tokens": max(0, self.output_tokens),
            "outcome": self.outcome,
        }
        if self.images:
            event["images"] = self.images
        if self.deployment:
            event["deployment"] = self.deployment
        if self.replica:
            event["replica"] = self.replica
        if self.admission_class in (GUARANTEED, BEST_EFFORT):
            event["admission_class"] = self.admission_class
        if self.api_key_prefix:
            # What the control plane checks against its admission record (which decides).
            event["api_key"] = self.api_key_prefix
        if self.ttft_ms is not None:
            event["ttft_ms"] = round(self.ttft_ms, 3)
        if self.held_ms is not None:
            event["held_ms"] = round(self.held_ms, 3)
        if self.streamed is not None:
            event["streamed"] = self.streamed
        if self.fallback_class is not None:
            event["fallback_class"] = self.fallback_class
        if self.prompts != 1 or self.sequences != 1:
            event["prompts"] = self.prompts
            event["sequences"] = self.sequences
        if self.engine_status is not None:
            event["engine_status"] = self.engine_status
        if self.outcome == "refused":
            event["estimated_mu"] = self.estimated_mu
        elif self.engine_usage and self.prompt_bytes is not None:
            event["prompt_bytes"] = self.prompt_bytes
        return event


_ISO_SECOND: list[Any] = [None, ""]  # the last whole second formatted, and its text


def _iso(moment: float) -> str:
    """`datetime.fromtimestamp(moment, UTC).isoformat()`, the date and time of day formatted
    once per second (two per request otherwise, on every worker's hot path)."""
    fraction, whole = math.modf(moment)
    micro = round(fraction * 1e6)  # half to even, as fromtimestamp rounds
    if micro >= 1_000_000:
        whole, micro = whole + 1.0, micro - 1_000_000
    elif micro < 0:  # before 1970
        whole, micro = whole - 1.0, micro + 1_000_000
    if _ISO_SECOND[0] != whole:
        text = datetime.fromtimestamp(whole, tz=UTC).isoformat()
        _ISO_SECOND[0], _ISO_SECOND[1] = whole, text.removesuffix("+00:00")
    if micro:
        return f"{_ISO_SECOND[1]}.{micro:06d}+00:00"
    return f"{_ISO_SECOND[1]}+00:00"
