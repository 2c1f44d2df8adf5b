"""The gateway's HTTP side: an aiohttp application (one event loop per worker process).

Per request: authenticate locally, check the body, estimate MU, admit in one Redis round
trip (`capacity.admission.redis_buckets.Buckets.admit`: the customer's and its key's request
limits, then the MU buckets), route to the ready replica with the least outstanding MU, forward
(SSE passed through), free its concurrency slot at its end, and leave exactly one usage event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError
from yarl import URL

from capacity.admission.redis_buckets import (
    BEST_EFFORT,
    GUARANTEED,
    REFUSED,
    AsyncBuckets,
    BucketDecision,
)

from .auth import Caller, authenticate, may_use
from .contract import WAITING, Contract, ContractReader, Model, Replica
from .errors import GatewayError
from .estimate import (
    CHAT,
    COMPLETION,
    Body,
    estimate_mu,
    input_tokens_of,
    max_output_tokens_of,
    output_tokens_of,
    parse_body,
)
from .metrics import (
    CONTRACT_VERSION,
    INFLIGHT_MU,
    OVERHEAD,
    REQUESTS,
    RETRIES,
    TTFT,
    exposition,
)
from .metrics import (
    WAITING as WAITING_GAUGE,
)
from .routing import Router
from .settings import Settings
from .usage import UsageSink

log = logging.getLogger("dataplane.gateway")

_JSON = {"Content-Type": "application/json"}

# vLLM's priority: lower is served first. Forwarded only to engines with priority scheduling.
PRIORITY = {GUARANTEED: 0, BEST_EFFORT: 1}

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")

WAKE_PATH = "/api/v1/allocation/wake"
WAKE_EVERY_SECONDS = 1.0
# A request held for a model that just woke asks admission again this often while the first
# allowances of the new replica are on their way.
ADMISSION_RETRY_SECONDS = 0.5

# In an SSE data event: a "usage" that is not null (the engine's counts: its final chunk, or
# every chunk with continuous usage stats). Only such events are parsed.
_USAGE = re.compile(rb'"usage"\s*:\s*(?!null)')
# A choice's generated text that is not empty: "text" (completions) or "content" (a chat delta).
# A quote inside a JSON string is escaped, so these bytes are a key, never a string's content.
_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')

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


_REQUEST_LIMITS = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "concurrency": "requests in flight",
}


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    """A release's answer: nothing to do with it (a Redis error is logged, the slot lapses)."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("freeing a concurrency slot failed: %s", future.exception())


class ClientGone(Exception):  # noqa: N818 - a signal: the client closed its connection
    """Writing to the client failed. aiohttp raises ClientConnectionResetError there, which is
    also an aiohttp.ClientError: left as it is, a client that leaves would read as a replica
    that failed (outcome error instead of cancelled)."""


async def _to_client(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError as error:
        raise ClientGone(str(error)) from error


class _TokenWatchdog:
    """A stream's per-token timeout: the engine's next bytes are due within `seconds` of the
    last ones (or of the answer's head). Counted only while the gateway waits for them, not
    while a slow client takes what was passed on (as aiohttp's sock_read pauses with reading).
    One timer per stream, set again only when it fires early, where sock_read cancels and sets
    a timer on every read; when it is due, the stream's next read raises a TimeoutError."""

    __slots__ = ("_content", "_handle", "_loop", "_seconds", "since")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, content: aiohttp.StreamReader
    ):
        self._loop = loop
        self._seconds = seconds
        self._content = content
        self.since: float | None = loop.time()  # waiting since; None while not waiting
        self._handle = loop.call_at(self.since + seconds, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        since = self.since
        if since is None or now < since + self._seconds:
            self._handle = self._loop.call_at((since or now) + self._seconds, self._check)
            return
        self._content.set_exception(
            aiohttp.ServerTimeoutError(f"no data from the engine within {self._seconds:g} s")
        )

    def cancel(self) -> None:
        self._handle.cancel()


class Retry(Exception):  # noqa: N818 - a signal, not a failure the client sees
    """An attempt failed before the client got a byte: another replica may take it."""

    def __init__(self, reason: str, status: int = 502, body: bytes = b""):
        super().__init__(reason)
        self.status = status
        self.body = body


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


class Gateway:
    def __init__(self, settings: Settings):
        self.settings = settings
        # Requests being answered, for a shutdown that lets them finish (`drain`).
        self._answering = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_seconds * 4,
            socket_connect_timeout=settings.redis_timeout_seconds * 4,
        )
        self.reader = ContractReader(self.redis, refresh_seconds=settings.refresh_seconds)
        # Admission: the control plane's own Lua script, on a connection of its own that
        # pipelines the decisions asked for while one round trip is under way.
        self.buckets = AsyncBuckets(
            self.redis,
            burst_seconds=settings.admission_burst_seconds,
            idle_ttl_seconds=settings.admission_limits_ttl_seconds,
            record_ttl_s=settings.admission_record_ttl_seconds,
            timeout_seconds=settings.redis_timeout_seconds,
            in_flight_ttl_seconds=settings.admission_concurrency_ttl_seconds,
        )
        self._redis_down_until = 0.0
        self.router = Router(load_factor=settings.affinity_load_factor)
        self.usage = UsageSink(
            redis_client=self.redis,
            control_plane_url=settings.control_plane_url,
            service_key=settings.service_key,
            batch_max=settings.usage_batch_max,
            flush_seconds=settings.usage_flush_seconds,
            spool_retry_seconds=settings.spool_retry_seconds,
            timeout_seconds=settings.usage_timeout_seconds,
        )
        self._waiting_script = self.redis.register_script(_WAITING_LUA)
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Built once: the upstream timeouts, and each replica's URLs (yarl parses a string on
        # every request otherwise). A stream's per-token timeout is not aiohttp's sock_read
        # (a timer cancelled and set again on every read): the answer's head and any error body
        # are read under one asyncio.timeout, its events under a _TokenWatchdog.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.connect_timeout_seconds, sock_read=None
        )
        self._unary_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.connect_timeout_seconds,
            sock_read=settings.request_timeout_seconds,
        )
        self._urls: dict[tuple[str, str], URL] = {}
        self._admission_from: Contract | None = None
        # model -> when this worker last asked the control plane for a tick (at most 1/s).
        self._woken_at: dict[str, float] = {}
        self._wakes: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
            trust_env=False,
            auto_decompress=False,
        )
        await self.usage.start()
        await self.reader.refresh()
        self._tasks = [
            asyncio.create_task(self._refresh_loop()),
            asyncio.create_task(self.usage.run()),
        ]

    async def stop(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.usage.close()
        if self.session is not None:
            await self.session.close()
        await self.buckets.close()
        await self.redis.aclose()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_seconds)
            try:
                if await self.reader.refresh() and self.reader.contract.version is not None:
                    CONTRACT_VERSION.set(self.reader.contract.version)
            except Exception:
                log.exception("contract refresh failed")

    # -- endpoints ------------------------------------------------------------------------

    async def healthz(self, _request: web.Request) -> web.Response:
        contract = self.reader.contract
        return web.json_response(
            {
                "status": "ok",
                "contract_version": contract.version,
                "contract_read_at": contract.read_at or None,
                "models": len(contract.models),
            }
        )

    async def readyz(self, request: web.Request) -> web.Response:
        if not self.reader.contract.loaded:
            return GatewayError(503, "No contract read from Redis yet.").response()
        return await self.healthz(request)

    async def metrics(self, _request: web.Request) -> web.Response:
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def models(self, request: web.Request) -> web.Response:
        contract = self._contract()
        caller = authenticate(
            contract,
            request.headers.get("Authorization"),
            request.headers.get(self.settings.customer_header),
            require_customer=False,
        )
        names = sorted(
            name
            for name in contract.models
            if caller.is_service and not caller.customer or may_use(contract, caller, name)
        )
        created = int(contract.published_at or 0)
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "model-unit-control-plane",
                "max_model_len": contract.models[name].context_length_tokens,
            }
            for name in names
        ]
        return web.json_response({"object": "list", "data": data})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, COMPLETION)

    async def _answer(self, request: web.Request, kind: str) -> web.StreamResponse:
        self._answering += 1
        self._idle.clear()
        try:
            return await self.generate(request, kind)
        finally:
            self._answering -= 1
            if not self._answering:
                self._idle.set()

    async def drain(self, _app: web.Application) -> None:
        """On SIGTERM, once the listener is closed: wait up to GATEWAY_SHUTDOWN_GRACE_SECONDS
        for the requests in flight to end (a rollout should not cut long streams); what is
        left is cancelled by aiohttp's own shutdown and recorded as cancelled."""
        if self._answering:
            log.info("shutting down: waiting for %d request(s) in flight", self._answering)
            try:
                await asyncio.wait_for(self._idle.wait(), self.settings.shutdown_grace_seconds)
            except TimeoutError:
                log.warning("shutting down: %d request(s) cut at the grace", self._answering)

    def _contract(self) -> Contract:
        contract = self.reader.contract
        if not contract.loaded:
            raise GatewayError(
                503, "The gateway has not read its contract from Redis yet.", code="not_ready"
            )
        return contract

    # -- one request ----------------------------------------------------------------------

    async def generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrived = time.perf_counter()
        started_at = time.time()
        request_id = "gw-" + os.urandom(16).hex()  # as random as uuid4's hex, 4x cheaper
        try:
            contract = self._contract()
            caller = authenticate(
                contract,
                request.headers.get("Authorization"),
                request.headers.get(self.settings.customer_header),
            )
            body = parse_body(kind, await self._json(request))
            model = contract.models.get(body.model)
            if model is None or not may_use(contract, caller, body.model):
                raise GatewayError(
                    404,
                    f"The model '{body.model[:100]}' does not exist or you do not have access "
                    "to it.",
                    code="model_not_found",
                    param="model",
                )
            model, usage, priority_class = await self._admit(
                contract, caller, body, model, request_id, started_at
            )
        except GatewayError as error:
            _counted("rejected", "none")
            return error.response(request_id)
        if usage.outcome == "refused":
            return self._refused(usage, model, request_id)
        try:
            return await self._serve(request, body, model, usage, priority_class, arrived)
        except asyncio.CancelledError:
            if usage.outcome != "completed":
                usage.outcome = "cancelled"
            raise
        finally:
            self._release(usage)
            self.usage.add(usage.event(time.time()))
            _counted(usage.outcome, usage.admission_class or "none")

    def _release(self, usage: Usage) -> None:
        """The request's end frees its concurrency slot at once (the usage event, which would
        free it too, may be a second or a spool away). Rides the admission pipeline, and is
        not awaited: the answer is out already, and a lost release lapses with its TTL."""
        if not usage.holds_slot:
            return
        usage.holds_slot = False
        released = self.buckets.release(
            customer_id=usage.customer_id,
            request_id=usage.request_id,
            api_key_prefix=usage.api_key_prefix,
        )
        released.add_done_callback(_ignore_outcome)

    async def _json(self, request: web.Request) -> Any:
        limit = self.settings.max_body_bytes

        def too_large() -> GatewayError:
            return GatewayError(
                413, f"The request body is larger than {limit} bytes.", code="request_too_large"
            )

        if request.content_length is not None and request.content_length > limit:
            raise too_large()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large() from None
        if len(raw) > limit:
            raise too_large()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise GatewayError(
                400,
                "The request body is not valid JSON.",
                code="invalid_json",
            ) from None

    async def _admit(
        self,
        contract: Contract,
        caller: Caller,
        body: Body,
        model: Model,
        request_id: str,
        started_at: float,
    ) -> tuple[Model, Usage, str]:
        """(the model that will serve, the usage so far, the admission class)."""
        chosen = model
        usage: Usage | None = None
        for candidate in (model, self._fallback(contract, caller, model)):
            if candidate is None:
                continue
            cap = candidate.degradation.max_tokens_cap
            if cap is not None and (body.max_tokens is None or body.max_tokens > cap):
                body.max_tokens = cap
            input_tokens = input_tokens_of(body, candidate)
            limit_tokens = input_tokens + max_output_tokens_of(body, candidate, input_tokens)
            mu = estimate_mu(
                candidate,
                input_tokens=input_tokens,
                output_tokens=output_tokens_of(body, candidate, input_tokens),
                images=body.images,
            )
            usage = Usage(
                request_id=request_id,
                customer=caller.customer,
                model=candidate.name,
                started_at=started_at,
                input_tokens=input_tokens,
                images=body.images,
                estimated_mu=mu,
                prompt_bytes=body.content_bytes if body.token_ids == 0 else None,
                limit_tokens=limit_tokens,
                customer_id=caller.customer_id,
                api_key_prefix=None if caller.is_service else caller.key.prefix,
            )
            held_until: float | None = None
            if not candidate.replicas:
                # A model at zero: hold the request before admission, as Knative's activator
                # does, since admission would lend it nothing until a replica is ready. The
                # waiting demand (gw:v1:waiting) and a wake-up ask the loop for one now.
                held_until = time.monotonic() + self.settings.cold_start_wait_seconds
                candidate = await self._wait_for_replica(candidate, mu, held_until)
                if not candidate.replicas:
                    usage.outcome = "refused"
                    usage.extra["not_ready"] = True
                    return candidate, usage, REFUSED
            admission_class, retry_after_ms = await self._decide(caller, candidate, usage)
            while admission_class == REFUSED and held_until is not None:
                # The model just woke: its first allowances follow the tick that readiness
                # triggers. Ask again until they do, within what is left of the hold.
                if time.monotonic() + ADMISSION_RETRY_SECONDS >= held_until:
                    break
                await asyncio.sleep(ADMISSION_RETRY_SECONDS)
                admission_class, retry_after_ms = await self._decide(caller, candidate, usage)
            usage.admission_class = admission_class
            chosen = candidate
            if admission_class != REFUSED:
                return chosen, usage, admission_class
            usage.outcome = "refused"
            usage.extra["retry_after_ms"] = retry_after_ms
            usage.admission_class = None
            if usage.extra.get("limit") not in (None, "mu"):
                break  # the customer's own limit: another model is under it too
        assert usage is not None
        return chosen, usage, REFUSED

    def _fallback(self, contract: Contract, caller: Caller, model: Model) -> Model | None:
        name = model.degradation.fallback_model
        if not name or name == model.name or not may_use(contract, caller, name):
            return None
        return contract.models.get(name)

    def _url(self, endpoint: str, kind: str) -> URL:
        url = self._urls.get((endpoint, kind))
        if url is None:
            if len(self._urls) > 4096:  # replicas come and go
                self._urls.clear()
            path = "/v1/chat/completions" if kind == CHAT else "/v1/completions"
            url = self._urls[endpoint, kind] = URL(endpoint + path)
        return url

    def _follow_admission_parameters(self) -> None:
        """The control plane's burst and TTLs when it published them (gw:v1:meta), else the
        GATEWAY_ADMISSION_* settings: the same rule with the same burst as the API's admission.
        Read again only when a new contract was read."""
        contract = self.reader.contract
        if contract is self._admission_from:
            return
        self._admission_from = contract
        published = contract.admission
        self.buckets.burst_seconds = published.get(
            "admission_burst_seconds", self.settings.admission_burst_seconds
        )
        self.buckets.idle_ttl_ms = int(
            1000
            * published.get(
                "admission_limits_ttl_seconds", self.settings.admission_limits_ttl_seconds
            )
        )
        self.buckets.record_ttl_s = int(
            published.get(
                "admission_record_ttl_seconds", self.settings.admission_record_ttl_seconds
            )
        )
        self.buckets.in_flight_ttl_ms = int(
            1000
            * published.get(
                "admission_concurrency_ttl_seconds",
                self.settings.admission_concurrency_ttl_seconds,
            )
        )

    async def _decide(self, caller: Caller, model: Model, usage: Usage) -> tuple[str, float]:
        """(admission class, retry after ms) from the Redis buckets, one round trip."""
        if time.monotonic() < self._redis_down_until:
            return self._without_redis()
        self._follow_admission_parameters()
        pending = self.buckets.submit(
            customer_id=caller.customer_id,
            model_id=model.model_id,
            cost_mu=usage.estimated_mu,
            request_id=usage.request_id,
            tokens=usage.limit_tokens,
            api_key_prefix=usage.api_key_prefix,
            # A client that leaves meanwhile does not unmake the decision (Redis takes and
            # records it all the same), so its usage event is still due.
            orphaned=lambda outcome: self._left_during_admission(outcome, model, usage),
        )
        try:
            decision = await pending
        except asyncio.CancelledError:
            if pending.done() and not pending.cancelled():  # decided just before
                outcome = pending.exception() or pending.result()
                self._left_during_admission(outcome, model, usage)
            raise
        except RedisError as error:
            return self._class_of(error, model, usage.customer_id)
        usage.extra["limit"] = decision.limit
        usage.extra["limit_scope"] = decision.limit_scope
        decided = self._class_of(decision, model, usage.customer_id)
        if decision.holds_slot:
            usage.holds_slot = True
            if decided[0] == REFUSED:  # refused after all (degradation): nothing holds it
                self._release(usage)
        return decided

    def _class_of(
        self, outcome: BucketDecision | BaseException, model: Model, customer_id: int | None
    ) -> tuple[str, float]:
        if isinstance(outcome, BaseException):
            log.warning("admission: Redis unreachable (%s)", outcome)
            self._redis_down_until = time.monotonic() + 1.0
            return self._without_redis()
        admission_class = outcome.admission_class
        if admission_class == BEST_EFFORT:
            tiers = self.reader.contract.customer_tiers
            tier = None if customer_id is None else tiers.get(customer_id)
            if model.degradation.refuses_best_effort_of(tier):
                return REFUSED, 1000.0
        return admission_class, outcome.retry_after_ms

    def _without_redis(self) -> tuple[str, float]:
        if self.settings.on_redis_down == "admit":
            return BEST_EFFORT, 0.0
        return REFUSED, 1000.0

    def _left_during_admission(
        self, outcome: BucketDecision | BaseException, model: Model, usage: Usage
    ) -> None:
        """The usage event of a request whose client left while Redis decided: refused, or
        cancelled with its class."""
        admission_class, _ = self._class_of(outcome, model, usage.customer_id)
        if admission_class == REFUSED:
            usage.outcome = "refused"
        else:
            usage.outcome = "cancelled"
            usage.admission_class = admission_class
            if isinstance(outcome, BucketDecision) and outcome.holds_slot:
                # Nobody waits for this request any more: its slot is free at once.
                self.buckets.release(
                    customer_id=usage.customer_id,
                    request_id=usage.request_id,
                    api_key_prefix=usage.api_key_prefix,
                ).add_done_callback(_ignore_outcome)
        self.usage.add(usage.event(time.time()))
        _counted(usage.outcome, usage.admission_class or "none")

    def _refused(self, usage: Usage, model: Model, request_id: str) -> web.Response:
        wait_ms = float(usage.extra.get("retry_after_ms", -1))
        seconds = (
            max(1, math.ceil(wait_ms / 1000.0))
            if wait_ms >= 0
            else self.settings.retry_after_seconds
        )
        self.usage.add(usage.event(time.time()))
        _counted("refused", "none")
        if usage.extra.get("not_ready"):
            # Held for the whole cold-start wait and still no replica: turned away as
            # demand (a refused event with its estimate), not as a rate limit.
            wait = max(1, int(self.settings.cold_start_wait_seconds))
            return GatewayError(
                503,
                f"The model '{model.name}' has no ready replica; it is being started. "
                "Retry shortly.",
                code="model_not_ready",
                headers={"Retry-After": str(wait)},
            ).response(request_id)
        limit = usage.extra.get("limit")
        if limit == "budget":
            # The budget of the customer (adm:rl:c:<customer> field `budget`) or of this key
            # (adm:rl:k:<prefix>) is spent and its hard cap refuses best-effort; the
            # reservation still admits.
            whose = "this API key's" if usage.extra.get("limit_scope") == "api_key" else "your"
            error = GatewayError(
                429,
                f"Budget reached: {whose} monthly budget is spent and its hard cap refuses "
                "requests beyond your reservation.",
                code="budget_exceeded",
                headers={"Retry-After": str(seconds)},
            )
        elif limit in _REQUEST_LIMITS:
            whose = "this API key's" if usage.extra.get("limit_scope") == "api_key" else "your"
            error = GatewayError(
                429,
                f"Rate limit reached: over {whose} limit of {_REQUEST_LIMITS[limit]}. "
                + (f"Retry after {seconds} s." if wait_ms >= 0 else "This request never fits."),
                code=f"{limit}_limit_exceeded",
                headers={"Retry-After": str(seconds)},
            )
        else:
            error = GatewayError(
                429,
                f"Rate limit reached for the model '{model.name}': over the reservation and "
                f"the best-effort allowance. Retry after {seconds} s.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(seconds)},
            )
        # Which limit bit, beside OpenAI's fields: "mu" (the MU buckets), "rpm", "tpm",
        # "concurrency" or "budget", and whose ("customer" or "api_key").
        error.extra = {"limit": limit or "mu", "limit_scope": usage.extra.get("limit_scope")}
        return error.response(request_id)

    # -- forwarding -----------------------------------------------------------------------

    async def _serve(
        self,
        request: web.Request,
        body: Body,
        model: Model,
        usage: Usage,
        admission_class: str,
        arrived: float,
    ) -> web.StreamResponse:
        settings = self.settings
        affinity = self._affinity(request, body)
        payloads: dict[bool, bytes] = {}
        tried: list[str] = []
        last: Retry | None = None
        attempt = 0
        deadline = time.monotonic() + settings.cold_start_wait_seconds
        while True:
            current = self.reader.contract.models.get(model.name) or model
            if not current.replicas and not tried:
                current = await self._wait_for_replica(current, usage.estimated_mu, deadline)
            replica = self.router.pick(current.replicas, affinity=affinity, exclude=tried)
            if replica is None:
                usage.outcome = "error"
                if last is not None:
                    return self._upstream_failed(last, usage.request_id)
                return GatewayError(
                    503,
                    f"The model '{model.name}' has no ready replica; it is being started. "
                    "Retry shortly.",
                    code="model_not_ready",
                    headers={"Retry-After": str(max(1, int(settings.cold_start_wait_seconds)))},
                ).response(usage.request_id)
            tried.append(replica.endpoint)
            if replica.priority_scheduling not in payloads:
                payloads[replica.priority_scheduling] = self._payload(
                    body, current, admission_class if replica.priority_scheduling else None
                )
            usage.deployment = replica.deployment or None
            usage.replica = replica.endpoint
            if attempt == 0:
                OVERHEAD.observe(time.perf_counter() - arrived)
            self.router.add(replica.endpoint, usage.estimated_mu)
            gauge = _inflight(replica.endpoint)
            gauge.inc(usage.estimated_mu)
            try:
                return await self._attempt(
                    request, body, replica, payloads[replica.priority_scheduling], usage, arrived
                )
            except Retry as retry:
                last = retry
                log.info("attempt on %s failed before the first byte: %s", replica.endpoint, retry)
            finally:
                self.router.done(replica.endpoint, usage.estimated_mu)
                gauge.dec(usage.estimated_mu)
            if attempt >= settings.retries:
                usage.outcome = "error"
                return self._upstream_failed(last, usage.request_id)
            attempt += 1
            RETRIES.inc()
            backoff = settings.retry_backoff_seconds * 2 ** (attempt - 1)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))  # noqa: S311 - jitter

    def _affinity(self, request: web.Request, body: Body) -> str | None:
        header = self.settings.session_header
        if header:
            session = request.headers.get(header)
            if session:
                return "s:" + session
        size = self.settings.prefix_affinity_bytes
        if size > 0 and body.prefix:
            return "p:" + body.prefix[:size]
        return None

    def _payload(self, body: Body, model: Model, admission_class: str | None) -> bytes:
        doc = dict(body.doc)
        doc["model"] = model.engine_model_id
        doc.pop("priority", None)
        if admission_class is not None and admission_class in PRIORITY:
            doc["priority"] = PRIORITY[admission_class]
        if body.max_tokens is not None:
            if "max_completion_tokens" in doc:
                doc["max_completion_tokens"] = body.max_tokens
            doc["max_tokens"] = body.max_tokens
        if body.stream:
            options = dict(doc.get("stream_options") or {})
            options["include_usage"] = True
            doc["stream_options"] = options
        return json.dumps(doc).encode()

    def _upstream_failed(self, last: Retry | None, request_id: str) -> web.Response:
        if last is not None and 500 <= last.status < 600 and last.body:
            try:
                json.loads(last.body)
            except ValueError:
                pass
            else:
                return web.Response(
                    status=last.status,
                    body=last.body,
                    content_type="application/json",
                    headers={"X-Request-Id": request_id},
                )
        reason = str(last) if last is not None else "no replica answered"
        return GatewayError(
            502, f"The model's replicas could not serve the request ({reason}).", code="upstream"
        ).response(request_id)

    async def _wait_for_replica(self, model: Model, mu: float, deadline: float) -> Model:
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
        now = time.monotonic()
        if not self.usage.url or now - self._woken_at.get(model, -WAKE_EVERY_SECONDS) < (
            WAKE_EVERY_SECONDS
        ):
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

    async def _attempt(
        self,
        request: web.Request,
        body: Body,
        replica: Replica,
        payload: bytes,
        usage: Usage,
        arrived: float,
    ) -> web.StreamResponse:
        assert self.session is not None
        url = self._url(replica.endpoint, body.kind)
        token_timeout = self.settings.token_timeout_seconds
        try:
            if body.stream:
                async with asyncio.timeout(token_timeout):
                    upstream = await self.session.post(
                        url, data=payload, headers=_JSON, timeout=self._stream_timeout
                    )
            else:
                upstream = await self.session.post(
                    url, data=payload, headers=_JSON, timeout=self._unary_timeout
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise Retry(f"{type(error).__name__}: {error}") from None
        try:
            if upstream.status >= 500:
                try:
                    async with asyncio.timeout(token_timeout if body.stream else None):
                        data = await upstream.read()
                except (aiohttp.ClientError, TimeoutError):
                    data = b""
                raise Retry(f"the replica answered {upstream.status}", upstream.status, data)
            if not body.stream:
                return await self._unary(upstream, usage, arrived)
            if upstream.status != 200:
                async with asyncio.timeout(token_timeout):
                    return await self._unary(upstream, usage, arrived)
            return await self._stream(request, body, upstream, usage, arrived)
        finally:
            # Closing (never reusing) an unfinished upstream connection is what makes the
            # engine abort the request: a client that left, a timeout, a failure.
            if not upstream.closed and not upstream.content.at_eof():
                upstream.close()
            else:
                upstream.release()

    async def _unary(
        self, upstream: aiohttp.ClientResponse, usage: Usage, arrived: float
    ) -> web.Response:
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise Retry(f"{type(error).__name__}: {error}") from None
        TTFT.observe(time.perf_counter() - arrived)
        content_type = upstream.headers.get("Content-Type", "application/json")
        if upstream.status == 200:
            try:
                doc = json.loads(data)
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                usage.take_engine_usage(doc.get("usage"))
            usage.outcome = "completed"
        else:
            usage.outcome = "error"
            usage.output_tokens = 0
        return web.Response(
            status=upstream.status,
            body=data,
            headers={"Content-Type": content_type, "X-Request-Id": usage.request_id},
        )

    async def _stream(
        self,
        request: web.Request,
        body: Body,
        upstream: aiohttp.ClientResponse,
        usage: Usage,
        arrived: float,
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        buffer = b""
        done = False
        delivered = False  # [DONE] written to the client: a disconnect now is not a cancel
        usage.output_tokens = 0
        loop = asyncio.get_running_loop()
        content = upstream.content
        watchdog = _TokenWatchdog(loop, self.settings.token_timeout_seconds, content)
        try:
            try:
                while True:
                    watchdog.since = loop.time()  # waiting for the engine from now
                    chunk = await content.readany()
                    watchdog.since = None  # not while the client takes it
                    if not chunk:
                        break
                    buffer = buffer + chunk if buffer else chunk
                    if buffer.endswith(b"\n\n"):  # the engine writes whole events
                        complete, buffer = buffer, b""
                    elif b"\n\n" in buffer:
                        complete, _, buffer = buffer.rpartition(b"\n\n")
                        complete += b"\n\n"
                    else:
                        continue
                    out, finished = pass_events(complete, body.include_usage, usage)
                    done = done or finished
                    if not out:
                        continue
                    if response is None:
                        response = await self._prepare(request, usage)
                        usage.ttft_ms = (time.time() - usage.started_at) * 1000.0
                        TTFT.observe(time.perf_counter() - arrived)
                    await _to_client(response, out)
                    delivered = done
            except (aiohttp.ClientError, TimeoutError) as error:
                # A per-token timeout (sock_read) or the replica gone.
                if response is None:
                    raise Retry(f"{type(error).__name__}: {error}") from None
                usage.outcome = "error"
                reason = (
                    f"no token within {self.settings.token_timeout_seconds:g} s"
                    if isinstance(error, TimeoutError)
                    else "the replica failed mid-stream"
                )
                await self._stream_error(response, reason)
                return response
            if response is None:
                if not done:
                    raise Retry("the replica closed the stream without an answer")
                response = await self._prepare(request, usage)
            if buffer.strip():
                out, finished = pass_events(buffer, body.include_usage, usage)
                done = done or finished
                if out:
                    await _to_client(response, out)
                    delivered = done
            if not done:
                usage.outcome = "error"
                await self._stream_error(response, "the replica ended the stream early")
                return response
            usage.outcome = "completed"
            await response.write_eof()
            return response
        except (ClientGone, ConnectionResetError):
            # The client left: the upstream is closed on the way out. A client that closes as
            # soon as it reads [DONE] (before the stream's last bytes) got the whole answer.
            usage.outcome = "completed" if delivered else "cancelled"
            return response if response is not None else web.Response(status=499)
        except asyncio.CancelledError:
            usage.outcome = "completed" if delivered else "cancelled"
            raise
        finally:
            watchdog.cancel()

    async def _prepare(self, request: web.Request, usage: Usage) -> web.StreamResponse:
        """The client's stream, opened; ClientGone when the client has already left."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": usage.request_id,
            }
        )
        try:
            await response.prepare(request)
        except ConnectionResetError as error:
            raise ClientGone(str(error)) from error
        return response

    async def _stream_error(self, response: web.StreamResponse, reason: str) -> None:
        error = {"error": {"message": reason, "type": "api_error", "param": None, "code": 504}}
        try:
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
        except ConnectionResetError:
            pass


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except GatewayError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return GatewayError(error.status, error.reason or "Error").response()


_COUNTERS: dict[tuple[str, str], Any] = {}
_INFLIGHT: dict[str, Any] = {}


def _counted(outcome: str, admission_class: str) -> None:
    """gateway_requests_total{outcome, admission_class} += 1 (the label child kept)."""
    child = _COUNTERS.get((outcome, admission_class))
    if child is None:
        child = _COUNTERS[outcome, admission_class] = REQUESTS.labels(outcome, admission_class)
    child.inc()


def _inflight(endpoint: str) -> Any:
    """gateway_inflight_mu{replica} (the label child kept)."""
    child = _INFLIGHT.get(endpoint)
    if child is None:
        if len(_INFLIGHT) > 4096:  # replicas come and go
            _INFLIGHT.clear()
        child = _INFLIGHT[endpoint] = INFLIGHT_MU.labels(endpoint)
    return child


def pass_events(data: bytes, include_usage: bool, usage: Usage) -> tuple[bytes, bool]:
    """(what to pass to the client, whether [DONE] came) of whole events (`data` ends with
    a blank line, or is the stream's unterminated end). The bytes pass through as they
    came; only an event whose `usage` is not null (the engine's usage chunk) is parsed: it
    gives the token counts, and is dropped when it has no choices and the client did not
    ask for it. Until the engine's usage comes, the choices with text are counted (by
    their bytes, not parsed), which is what a stream cut short is charged."""
    # The common read: whole data events, none of them [DONE] or the usage: the bytes as they
    # came, their text choices counted in one scan (what the loop below does, event by event).
    if (
        data.endswith(b"\n\n")
        and data.startswith(b"data:")
        and data.count(b"\n\n") == data.count(b"\n\ndata:") + 1
        and b"[DONE]" not in data
        and not (b'"usage"' in data and _USAGE.search(data))
    ):
        if not usage.engine_usage:
            usage.output_tokens += len(_TEXT.findall(data))
        return data, False
    events = data.split(b"\n\n")
    terminated = not events[-1]
    if terminated:
        events.pop()
    kept: list[bytes] | None = None  # None: every event passed on unchanged
    done = False
    for index, event in enumerate(events):
        payload = event.strip()
        keep = bool(payload)
        if payload.startswith(b"data:"):
            text = payload[5:].strip()
            if text == b"[DONE]":
                done = True
            elif b'"usage"' in text and _USAGE.search(text):
                keep = _usage_event(text, include_usage, usage)
            elif not usage.engine_usage:
                usage.output_tokens += len(_TEXT.findall(text))
        if keep and kept is not None:
            kept.append(event)
        elif not keep and kept is None:
            kept = events[:index]
    if kept is None and terminated:
        return data, done
    parts = events if kept is None else kept
    return b"".join(event + b"\n\n" for event in parts), done


def _usage_event(text: bytes, include_usage: bool, usage: Usage) -> bool:
    """Takes the engine's usage from a data event that has some; whether to pass it on."""
    try:
        doc = json.loads(text)
    except ValueError:
        return True
    if not isinstance(doc, dict):
        return True
    choices = doc.get("choices")
    if doc.get("usage"):
        usage.take_engine_usage(doc["usage"])
        if not choices and not include_usage:
            return False
    if choices and not usage.engine_usage:
        usage.output_tokens += sum(
            1
            for c in choices
            if isinstance(c, dict) and (c.get("text") or (c.get("delta") or {}).get("content"))
        )
    return True


def create_app(settings: Settings) -> web.Application:
    # The body limit is enforced by the handler (an OpenAI-shaped 413); aiohttp's own limit
    # sits just above it.
    app = web.Application(client_max_size=settings.max_body_bytes + 1, middlewares=[_errors])
    gateway = Gateway(settings)
    app[GATEWAY_KEY] = gateway
    app.on_startup.append(gateway.start)
    app.on_shutdown.append(gateway.drain)
    app.on_cleanup.append(gateway.stop)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/metrics", gateway.metrics)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    return app
