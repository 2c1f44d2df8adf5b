"""The gateway's requests: one Gateway per worker process (one event loop).

Per request: authenticate locally, check the body, estimate MU, admit in one Redis round
trip (`capacity.admission.redis_buckets.Buckets.admit`: the customer's and its key's request
limits, then the MU buckets), route to the ready replica with the least outstanding MU, forward
(SSE passed through, dataplane/gateway/relay.py), free its concurrency slot at its end, and
leave exactly one usage event. HTTP itself: dataplane/gateway/http.py (the clients) and
dataplane/gateway/upstream.py (the engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from capacity.admission.bucket import LocalBuckets
from capacity.admission.redis_buckets import (
    BEST_EFFORT,
    GUARANTEED,
    REFUSED,
    REFUSED_GUARANTEED,
    AsyncBuckets,
    BucketDecision,
)

from .auth import Caller, authenticate, may_use
from .contract import WAITING, WORKERS, Contract, ContractReader, Model, Replica
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
from .http import ClientGone, Exchange, Request
from .metrics import (
    CONTRACT_VERSION,
    FALLBACK_DECISIONS,
    INFLIGHT_MU,
    OVERHEAD,
    REQUESTS,
    RETRIES,
    exposition,
)
from .metrics import (
    WAITING as WAITING_GAUGE,
)
from .relay import EngineAnswer, Retry
from .routing import Router
from .settings import Settings
from .upstream import EngineConnection, Engines
from .usage import Usage, UsageSink

log = logging.getLogger("dataplane.gateway")

# vLLM's priority: lower is served first. Forwarded only to engines with priority scheduling.
PRIORITY = {GUARANTEED: 0, BEST_EFFORT: 1}

WAKE_PATH = "/api/v1/allocation/wake"
# How often a worker refreshes its heartbeat in gw:v1:workers (the reaper waits
# USAGE_REAP_GRACE_SECONDS, minutes, past the last one).
ALIVE_EVERY_SECONDS = 2.0
WAKE_EVERY_SECONDS = 1.0
# A request held for a model that just woke asks admission again this often while the first
# allowances of the new replica are on their way.
ADMISSION_RETRY_SECONDS = 0.5

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
        self.reader = ContractReader(
            self.redis,
            refresh_seconds=settings.refresh_seconds,
            publication_keys=settings.publication_public_keys,
            skew_seconds=settings.publication_skew_seconds,
        )
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
        # While Redis cannot be reached: this worker's buckets, each customer's reservation
        # floor times its share (settings.fallback_share), under the one rule; best-effort
        # refused (capacity.admission.bucket).
        self._local = LocalBuckets(burst_seconds=settings.admission_burst_seconds)
        # Who answers the requests this worker admits, in their admission records: while its
        # heartbeat (gw:v1:workers) lives, the reaper leaves their usage events to it.
        self.owner = "g" + os.urandom(8).hex()
        self._alive_at = 0.0
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
        # The control plane's wake endpoint (not the hot path): aiohttp's client.
        self.session: aiohttp.ClientSession | None = None
        self.engines = Engines(connect_timeout_seconds=settings.connect_timeout_seconds)
        self._tasks: list[asyncio.Task[None]] = []
        # Each replica's (host, port) and each request line with its Host header, built once.
        self._targets: dict[tuple[str, str], tuple[tuple[str, int], bytes]] = {}
        self._admission_from: Contract | None = None
        # model -> when this worker last asked the control plane for a tick (at most 1/s).
        self._woken_at: dict[str, float] = {}
        self._wakes: set[asyncio.Task[None]] = set()
        # Header names as http.py keeps them (lower case).
        self._customer_header = settings.customer_header.lower()
        self._session_header = settings.session_header.lower()
        self._routes: dict[str, tuple[str, Any]] = {
            "/v1/chat/completions": ("POST", self.chat_completions),
            "/v1/completions": ("POST", self.completions),
            "/v1/models": ("GET", self.models),
            "/metrics": ("GET", self.metrics),
            "/healthz": ("GET", self.healthz),
            "/readyz": ("GET", self.readyz),
        }

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(trust_env=False)
        await self.usage.start()
        if not self.reader.publication_keys:
            log.warning(
                "GATEWAY_PUBLICATION_KEYS is not set: publications are taken unsigned, so "
                "whoever can write to Redis can publish a key (docs/gateway-contract.md)"
            )
        await self.reader.refresh()
        await self._alive()
        self._tasks = [
            asyncio.create_task(self._refresh_loop()),
            asyncio.create_task(self.usage.run()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.usage.close()
        # Every event is handed over: nothing of this worker's is left for the reaper to wait
        # for (a worker that dies without this is reaped once its heartbeat is old).
        with contextlib.suppress(RedisError, OSError):
            await self.redis.hdel(WORKERS, self.owner)
        self.engines.close()
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
                if time.monotonic() - self._alive_at >= ALIVE_EVERY_SECONDS:
                    await self._alive()
            except Exception:
                log.exception("contract refresh failed")

    async def _alive(self) -> None:
        """This worker's heartbeat (gw:v1:workers): its requests' usage events are still due
        from it, so the control plane's reaper waits for them."""
        try:
            await self.redis.hset(WORKERS, self.owner, str(int(time.time() * 1000)))
            self._alive_at = time.monotonic()
        except (RedisError, OSError) as error:
            log.debug("gw:v1:workers not refreshed (%s)", error)

    # -- endpoints ------------------------------------------------------------------------

    async def dispatch(self, request: Request, exchange: Exchange) -> None:
        """The one handler of http.py: the route by path, then by method."""
        route = self._routes.get(request.path)
        if route is None:
            GatewayError(404, f"No such path: {request.path[:200]}", code="not_found").respond(
                exchange
            )
            return
        method, handler = route
        if request.method != method:
            error = GatewayError(
                405,
                f"{request.method[:20]} is not allowed here; use {method}.",
                code="method_not_allowed",
                headers={"Allow": method},
            )
            error.respond(exchange)
            return
        try:
            await handler(request, exchange)
        except GatewayError as error:
            error.respond(exchange)

    async def healthz(self, _request: Request, exchange: Exchange) -> None:
        contract = self.reader.contract
        _json_answer(
            exchange,
            {
                "status": "ok",
                "contract_version": contract.version,
                "contract_read_at": contract.read_at or None,
                "models": len(contract.models),
            },
        )

    async def readyz(self, request: Request, exchange: Exchange) -> None:
        if not self.reader.contract.loaded:
            raise GatewayError(503, "No contract read from Redis yet.")
        await self.healthz(request, exchange)

    async def metrics(self, _request: Request, exchange: Exchange) -> None:
        body, content_type = exposition()
        exchange.respond(200, body, content_type=content_type)

    async def models(self, request: Request, exchange: Exchange) -> None:
        contract = self._contract()
        caller = authenticate(
            contract,
            request.headers.get("authorization"),
            request.headers.get(self._customer_header),
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
        _json_answer(exchange, {"object": "list", "data": data})

    async def chat_completions(self, request: Request, exchange: Exchange) -> None:
        await self._answer(request, exchange, CHAT)

    async def completions(self, request: Request, exchange: Exchange) -> None:
        await self._answer(request, exchange, COMPLETION)

    async def _answer(self, request: Request, exchange: Exchange, kind: str) -> None:
        self._answering += 1
        self._idle.clear()
        try:
            await self.generate(request, exchange, kind)
        finally:
            self._answering -= 1
            if not self._answering:
                self._idle.set()

    @property
    def answering(self) -> int:
        return self._answering

    async def drain(self) -> None:
        """On SIGTERM, once the listener is closed: wait up to GATEWAY_SHUTDOWN_GRACE_SECONDS
        for the requests in flight to end (a rollout should not cut long streams); what is
        left is then cancelled (runner.py) and recorded as cancelled."""
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

    async def generate(self, request: Request, exchange: Exchange, kind: str) -> None:
        arrived = time.perf_counter()
        started_at = time.time()
        request_id = "gw-" + os.urandom(16).hex()  # as random as uuid4's hex, 4x cheaper
        pending: list[Usage] = []  # the request's usage as admission builds it
        try:
            contract = self._contract()
            caller = authenticate(
                contract,
                request.headers.get("authorization"),
                request.headers.get(self._customer_header),
            )
            body = parse_body(
                kind,
                self._json(request),
                max_prompts=self.settings.max_prompts,
                max_n=self.settings.max_n,
            )
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
                contract, caller, body, model, request_id, started_at, pending
            )
        except GatewayError as error:
            if pending and not pending[-1].recorded:
                self._abandoned(pending[-1])  # its decision stands, and leaves its event
            else:
                _counted("rejected", "none")
            error.respond(exchange, request_id)
            return
        except asyncio.CancelledError:
            # The client left before its request was forwarded: while it was held for a cold
            # start, or between two asks of admission. Its one usage event all the same.
            if pending and not pending[-1].recorded:
                self._abandoned(pending[-1])
            raise
        if usage.outcome == "refused":
            self._refused(exchange, usage, model, request_id)
            return
        try:
            await self._serve(request, exchange, body, model, usage, priority_class, arrived)
        except asyncio.CancelledError:
            if usage.outcome != "completed":
                usage.outcome = "cancelled"
            raise
        finally:
            self._release(usage)
            self._record(usage)

    def _record(self, usage: Usage) -> None:
        """Hand the request's one usage event to the sink (at most once)."""
        if usage.recorded:
            return
        usage.recorded = True
        self.usage.add(usage.event(time.time()))
        _counted(usage.outcome, usage.admission_class or "none")

    def _abandoned(self, usage: Usage) -> None:
        """The event of a request that ended before it was forwarded: cancelled in its class
        when it was admitted, refused when its last decision refused it, and cancelled with no
        class when it was never decided (held for a cold start all along). One whose decision is
        still on its way from Redis leaves its event when the decision comes (`orphaned`)."""
        if usage.extra.get("deciding"):
            return
        if usage.admission_class in (GUARANTEED, BEST_EFFORT):
            usage.outcome = "cancelled"
            self._release(usage)
        elif usage.extra.get("decided"):
            usage.outcome = "refused"
            usage.admission_class = None
        else:
            usage.outcome = "cancelled"
        self._record(usage)

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

    def _json(self, request: Request) -> Any:
        if request.body_too_large:
            raise GatewayError(
                413,
                f"The request body is larger than {self.settings.max_body_bytes} bytes.",
                code="request_too_large",
            )
        try:
            return json.loads(request.body)
        except (ValueError, UnicodeDecodeError):
            raise GatewayError(
                400,
                "The request body is not valid JSON.",
                code="invalid_json",
            ) from None
        except RecursionError:  # arrays or objects nested thousands deep
            raise GatewayError(
                400, "The request body is nested too deeply.", code="too_deep"
            ) from None

    async def _admit(
        self,
        contract: Contract,
        caller: Caller,
        body: Body,
        model: Model,
        request_id: str,
        started_at: float,
        pending: list[Usage],
    ) -> tuple[Model, Usage, str]:
        """(the model that will serve, the usage so far, the admission class). Each usage it
        builds is appended to `pending` first, so a request that ends here still leaves one."""
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
                prompts=body.prompts,
                sequences=body.sequences,
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
                streamed=body.stream,
                prompts=body.prompts,
                sequences=body.sequences,
            )
            pending.append(usage)
            held_until: float | None = None
            held_from = time.monotonic()
            try:
                if not candidate.replicas:
                    # A model at zero: hold the request before admission, as Knative's
                    # activator does, since admission would lend it nothing until a replica is
                    # ready. The waiting demand (gw:v1:waiting) and a wake-up ask the loop for
                    # one now.
                    held_until = held_from + self.settings.cold_start_wait_seconds
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
            finally:
                if held_until is not None:
                    # The cold start it waited through, kept apart from its TTFT (which counts
                    # from here): the SLA counts it only where the customer keeps warm.
                    usage.held_ms = (time.monotonic() - held_from) * 1000.0
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

    def _target(self, endpoint: str, kind: str) -> tuple[tuple[str, int], bytes]:
        """A replica's (host, port) and the head of a request to it, up to its length."""
        target = self._targets.get((endpoint, kind))
        if target is None:
            if len(self._targets) > 4096:  # replicas come and go
                self._targets.clear()
            url = urlsplit(endpoint)
            host = url.hostname or "127.0.0.1"
            port = url.port or (443 if url.scheme == "https" else 80)
            path = url.path.rstrip("/") + (
                "/v1/chat/completions" if kind == CHAT else "/v1/completions"
            )
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode("latin-1")
            target = self._targets[endpoint, kind] = ((host, port), head)
        return target

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
        # How the best-effort allowances age with the tick's heartbeat: the control plane's
        # (absent from an older one: the script's defaults, the live defaults).
        for name, attribute in (
            ("admission_best_effort_fresh_seconds", "best_effort_fresh_ms"),
            ("admission_best_effort_stale_seconds", "best_effort_stale_ms"),
        ):
            if name in published:
                setattr(self.buckets, attribute, int(1000 * published[name]))
        self._local.burst_seconds = self.buckets.burst_seconds

    async def _decide(self, caller: Caller, model: Model, usage: Usage) -> tuple[str, float]:
        """(admission class, retry after ms) from the Redis buckets, one round trip; from this
        worker's share of the reservation while Redis cannot be reached."""
        if time.monotonic() < self._redis_down_until:
            return self._without_redis(model, usage)
        self._follow_admission_parameters()
        tier = self.reader.contract.customer_tiers.get(usage.customer_id)
        pending = self.buckets.submit(
            customer_id=caller.customer_id,
            model_id=model.model_id,
            cost_mu=usage.estimated_mu,
            request_id=usage.request_id,
            tokens=usage.limit_tokens,
            api_key_prefix=usage.api_key_prefix,
            # A client that leaves meanwhile does not unmake the decision (Redis takes and
            # records it all the same), so its usage event is still due.
            orphaned=lambda outcome: self._left_during_admission(outcome, usage),
            # Degradation sheds in the same decision (the script takes the best-effort bucket
            # away): nothing Redis admits and records is refused afterwards.
            shed=model.degradation.refuses_best_effort_of(tier),
            owner=self.owner,
        )
        # Until Redis answers, its event is the decision's to leave (`orphaned` above), not
        # the abandoning handler's (_abandoned).
        usage.extra["deciding"] = True
        try:
            decision = await pending
        except asyncio.CancelledError:
            if pending.done() and not pending.cancelled():  # decided just before
                outcome = pending.exception() or pending.result()
                self._left_during_admission(outcome, usage)
            raise
        except RedisError as error:
            usage.extra["deciding"] = False
            log.warning("admission: Redis unreachable (%s)", error)
            self._redis_down_until = time.monotonic() + 1.0
            return self._without_redis(model, usage)
        usage.extra["deciding"] = False
        usage.extra["decided"] = True
        usage.fallback_class = None  # an earlier ask may have fallen back
        usage.extra["limit"] = decision.limit
        usage.extra["limit_scope"] = decision.limit_scope
        if decision.holds_slot:
            usage.holds_slot = True
        return decision.admission_class, decision.retry_after_ms

    def _without_redis(self, model: Model, usage: Usage) -> tuple[str, float]:
        """Redis cannot be reached: the customer's reservation floor (the contract's copy)
        times this worker's share, from a bucket of this worker under the one rule, and
        best-effort refused; nothing without a reservation. The decision rides the usage event
        (`fallback_class`), which ingestion bills by (verification "fallback")."""
        FALLBACK_DECISIONS.inc()
        usage.extra["decided"] = True
        reserved = 0.0
        floors = self.reader.contract.reservations.get(usage.customer_id)
        floor = floors.get(model.name) if floors else None
        if floor is not None:
            reserved = floor.at(time.time() * 1000.0)
        usage.extra["limit"] = "mu"
        usage.extra["limit_scope"] = None
        wait_ms = 1000.0
        if self.settings.on_redis_down == "guaranteed" and reserved > 0:
            key = (usage.customer_id, model.model_id)
            decision = self._local.split(
                ("g", *key),
                ("be", *key),
                cost_mu=usage.estimated_mu,
                guaranteed_mu_per_minute=reserved * self.settings.fallback_share,
                best_effort_mu_per_minute=0.0,
                now_ms=time.monotonic() * 1000.0,
            )
            if decision.admitted:
                usage.fallback_class = GUARANTEED
                usage.extra["limit"] = None
                return GUARANTEED, 0.0
            if decision.wait_ms >= 0:
                wait_ms = max(wait_ms, decision.wait_ms)
        usage.fallback_class = REFUSED_GUARANTEED if reserved > 0 else REFUSED
        return REFUSED, wait_ms

    def _left_during_admission(self, outcome: BucketDecision | BaseException, usage: Usage) -> None:
        """The usage event of a request whose client left while Redis decided: refused, or
        cancelled with its class (or with none, when Redis failed to decide)."""
        if isinstance(outcome, BaseException):
            usage.outcome = "cancelled"
            usage.admission_class = None
        elif outcome.admission_class == REFUSED:
            usage.outcome = "refused"
            usage.admission_class = None
        else:
            usage.outcome = "cancelled"
            usage.admission_class = outcome.admission_class
            if outcome.holds_slot:
                # Nobody waits for this request any more: its slot is free at once.
                self.buckets.release(
                    customer_id=usage.customer_id,
                    request_id=usage.request_id,
                    api_key_prefix=usage.api_key_prefix,
                ).add_done_callback(_ignore_outcome)
        self._record(usage)

    def _refused(self, exchange: Exchange, usage: Usage, model: Model, request_id: str) -> None:
        wait_ms = float(usage.extra.get("retry_after_ms", -1))
        seconds = (
            max(1, math.ceil(wait_ms / 1000.0))
            if wait_ms >= 0
            else self.settings.retry_after_seconds
        )
        self._record(usage)
        if usage.extra.get("not_ready"):
            # Held for the whole cold-start wait and still no replica: turned away as
            # demand (a refused event with its estimate), not as a rate limit.
            wait = max(1, int(self.settings.cold_start_wait_seconds))
            GatewayError(
                503,
                f"The model '{model.name}' has no ready replica; it is being started. "
                "Retry shortly.",
                code="model_not_ready",
                headers={"Retry-After": str(wait)},
            ).respond(exchange, request_id)
            return
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
        error.respond(exchange, request_id)

    # -- forwarding -----------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        exchange: Exchange,
        body: Body,
        model: Model,
        usage: Usage,
        admission_class: str,
        arrived: float,
    ) -> None:
        settings = self.settings
        affinity = self._affinity(request, body)
        payloads: dict[bool, bytes] = {}
        tried: list[str] = []
        last: Retry | None = None
        attempt = 0
        # Whether every attempt so far found no engine listening (connection refused).
        unreachable_only = True
        deadline = time.monotonic() + settings.cold_start_wait_seconds
        while True:
            current = self.reader.contract.models.get(model.name) or model
            if not current.replicas and not tried:
                # Admitted while a replica was published, and none is left now: held again,
                # and that hold is a cold start too, kept apart from its TTFT.
                held_from = time.monotonic()
                try:
                    current = await self._wait_for_replica(current, usage.estimated_mu, deadline)
                finally:
                    usage.held_ms = (usage.held_ms or 0.0) + (time.monotonic() - held_from) * 1000.0
            replica = self.router.pick(current.replicas, affinity=affinity, exclude=tried)
            left = deadline - time.monotonic()
            if replica is None and last is not None and unreachable_only and left > 0:
                # Every published replica refused the connection: none listens yet (a
                # fleet restarted before the control plane saw it, a replica being
                # replaced). The request reached none of them, so it waits, as it would
                # for a model at zero, for the contract to change (a second at most) and
                # tries them again, until the cold-start wait is over.
                await self.reader.changed(min(left, 1.0))
                tried.clear()
                continue
            if replica is None:
                usage.outcome = "error"
                if last is not None:
                    self._upstream_failed(exchange, last, usage.request_id)
                    return
                GatewayError(
                    503,
                    f"The model '{model.name}' has no ready replica; it is being started. "
                    "Retry shortly.",
                    code="model_not_ready",
                    headers={"Retry-After": str(max(1, int(settings.cold_start_wait_seconds)))},
                ).respond(exchange, usage.request_id)
                return
            tried.append(replica.endpoint)
            if replica.priority_scheduling not in payloads:
                payloads[replica.priority_scheduling] = self._payload(
                    body, current, admission_class if replica.priority_scheduling else None
                )
            usage.deployment = replica.deployment or None
            usage.replica = replica.endpoint
            if last is None:
                OVERHEAD.observe(time.perf_counter() - arrived)
            else:
                RETRIES.inc()  # every attempt after a failed one
            self.router.add(replica.endpoint, usage.estimated_mu)
            gauge = _inflight(replica.endpoint)
            gauge.inc(usage.estimated_mu)
            try:
                await self._attempt(
                    exchange, body, replica, payloads[replica.priority_scheduling], usage, arrived
                )
                return
            except Retry as retry:
                last = retry
                log.info("attempt on %s failed before the first byte: %s", replica.endpoint, retry)
            finally:
                self.router.done(replica.endpoint, usage.estimated_mu)
                gauge.dec(usage.estimated_mu)
            if last.unreachable and unreachable_only:
                continue  # refused at once: the next replica now, and no retry spent
            unreachable_only = False
            if attempt >= settings.retries:
                usage.outcome = "error"
                self._upstream_failed(exchange, last, usage.request_id)
                return
            attempt += 1
            backoff = settings.retry_backoff_seconds * 2 ** (attempt - 1)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))  # noqa: S311 - jitter

    def _affinity(self, request: Request, body: Body) -> str | None:
        header = self._session_header
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

    def _upstream_failed(self, exchange: Exchange, last: Retry | None, request_id: str) -> None:
        if last is not None and 500 <= last.status < 600 and last.body:
            try:
                json.loads(last.body)
            except ValueError:
                pass
            else:
                exchange.respond(last.status, last.body, headers={"X-Request-Id": request_id})
                return
        reason = str(last) if last is not None else "no replica answered"
        GatewayError(
            502, f"The model's replicas could not serve the request ({reason}).", code="upstream"
        ).respond(exchange, request_id)

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
        exchange: Exchange,
        body: Body,
        replica: Replica,
        payload: bytes,
        usage: Usage,
        arrived: float,
    ) -> None:
        """One replica's try: Retry while nothing reached the client."""
        address, head = self._target(replica.endpoint, body.kind)
        data = head + b"%d\r\n\r\n%b" % (len(payload), payload)
        connection, answer = await self._first_byte(address, data, exchange, body, usage, arrived)
        try:
            if answer.status != 200 or not body.stream:
                self._collected(exchange, answer, usage)
                return
            await answer.finished
        finally:
            if not answer.complete:
                # Cancelled (the client left, or shutdown): the engine aborts the request.
                connection.abort()

    async def _first_byte(
        self,
        address: tuple[str, int],
        data: bytes,
        exchange: Exchange,
        body: Body,
        usage: Usage,
        arrived: float,
    ) -> tuple[EngineConnection, EngineAnswer]:
        """The request sent, and its answer past the point of no retry (Retry before)."""
        connection = self.engines.take(address)
        kept_alive = connection is not None
        while True:
            if connection is None:
                try:
                    connection = await self.engines.connect(address)
                except (OSError, TimeoutError) as error:
                    raise Retry(f"{type(error).__name__}: {error}", unreachable=True) from None
            answer = EngineAnswer(
                connection=connection,
                exchange=exchange,
                usage=usage,
                stream=body.stream,
                include_usage=body.include_usage,
                timeout_seconds=(
                    self.settings.token_timeout_seconds
                    if body.stream
                    else self.settings.request_timeout_seconds
                ),
                arrived=arrived,
                # TTFT counts from the end of any hold for a cold start (held_ms, apart).
                started_at=usage.started_at + (usage.held_ms or 0.0) / 1000.0,
            )
            connection.send(data, answer)
            try:
                await answer.first
            except Retry as retry:
                if kept_alive and retry.connection_lost and answer.status == 0:
                    # A kept-alive connection the engine had closed meanwhile: not the
                    # replica's failure. Once more, on a new connection.
                    kept_alive, connection = False, None
                    continue
                raise
            except ClientGone:
                raise asyncio.CancelledError() from None
            except asyncio.CancelledError:
                connection.abort()
                raise
            return connection, answer

    def _collected(self, exchange: Exchange, answer: EngineAnswer, usage: Usage) -> None:
        """A whole answer: a non-streamed one, or an engine's error status."""
        data = answer.collected()
        if answer.status >= 500:
            raise Retry(f"the replica answered {answer.status}", answer.status, data)
        if answer.status == 200:
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
            if 400 <= answer.status < 500:
                # Refused by the engine before any work (a prompt over the context, a
                # parameter it does not take): nothing to bill.
                usage.engine_status = answer.status
        exchange.respond(
            answer.status,
            data,
            content_type=answer.content_type or "application/json",
            headers={"X-Request-Id": usage.request_id},
        )


def _json_answer(exchange: Exchange, doc: Any, status: int = 200) -> None:
    exchange.respond(status, json.dumps(doc).encode())


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
