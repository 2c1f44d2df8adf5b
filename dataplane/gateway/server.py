"""One gateway worker (one event loop): its routes, and each request's path through it.

Per request: authenticate locally (auth.py), check the body and estimate MU (estimate.py),
admit in one Redis round trip, holding a request for a model at zero first (admission.py,
holding.py), answer a refusal (refusals.py), forward to a replica and relay its answer
(forwarding.py), free its concurrency slot at its end, and leave exactly one usage event
(usage.py). The worker's life: it reads the contract (contract.py) and beats its heartbeat
(heartbeat.py) until it is stopped, after letting its requests in flight end (`drain`). HTTP
itself: dataplane/gateway/http.py (the clients) and dataplane/gateway/upstream.py (the engines).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import redis.asyncio as aioredis

from .admission import Admission
from .auth import authenticate, may_use
from .contract import Contract, ContractReader
from .errors import GatewayError
from .estimate import CHAT, COMPLETION, parse_body
from .forwarding import Forwarder
from .heartbeat import Heartbeat
from .holding import Holding
from .http import Exchange, Request
from .metrics import CONTRACT_VERSION, count_request, exposition
from .refusals import refusal
from .settings import Settings
from .usage import Usage, UsageSink

log = logging.getLogger("dataplane.gateway")


class Gateway:
    """The worker: its parts, built once, and the handler of every request it takes."""

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
        self.usage = UsageSink(
            redis_client=self.redis,
            control_plane_url=settings.control_plane_url,
            service_key=settings.service_key,
            batch_max=settings.usage_batch_max,
            flush_seconds=settings.usage_flush_seconds,
            spool_retry_seconds=settings.spool_retry_seconds,
            timeout_seconds=settings.usage_timeout_seconds,
        )
        self.heartbeat = Heartbeat(self.redis)
        self.holding = Holding(self.redis, self.reader, settings)
        self.admission = Admission(
            settings,
            redis=self.redis,
            reader=self.reader,
            holding=self.holding,
            sink=self.usage,
            owner=self.heartbeat.owner,
        )
        self.forwarder = Forwarder(settings, reader=self.reader, holding=self.holding)
        self._tasks: list[asyncio.Task[None]] = []
        # The header name as http.py keeps it (lower case).
        self._customer_header = settings.customer_header.lower()
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
        self.holding.open()
        await self.usage.start()
        if not self.reader.publication_keys:
            log.warning(
                "GATEWAY_PUBLICATION_KEYS is not set: publications are taken unsigned, so "
                "whoever can write to Redis can publish a key (docs/gateway-contract.md)"
            )
        await self.reader.refresh()
        await self.heartbeat.beat()
        self._tasks = [
            asyncio.create_task(self._refresh_loop()),
            asyncio.create_task(self.usage.run()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.usage.close()
        await self.heartbeat.leave()
        self.forwarder.close()
        await self.holding.close()
        await self.admission.close()
        await self.redis.aclose()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_seconds)
            try:
                if await self.reader.refresh() and self.reader.contract.version is not None:
                    CONTRACT_VERSION.set(self.reader.contract.version)
                if self.heartbeat.due:
                    await self.heartbeat.beat()
            except Exception:
                log.exception("contract refresh failed")

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
            model, usage, priority_class = await self.admission.admit(
                contract, caller, body, model, request_id, started_at, pending
            )
        except GatewayError as error:
            if pending and not pending[-1].recorded:
                self.admission.abandoned(pending[-1])  # its decision stands, and leaves its event
            else:
                count_request("rejected", "none")
            error.respond(exchange, request_id)
            return
        except asyncio.CancelledError:
            # The client left before its request was forwarded: while it was held for a cold
            # start, or between two asks of admission. Its one usage event all the same.
            if pending and not pending[-1].recorded:
                self.admission.abandoned(pending[-1])
            raise
        if usage.outcome == "refused":
            self.usage.record(usage)
            refusal(usage, model, self.settings).respond(exchange, request_id)
            return
        try:
            await self.forwarder.serve(
                request, exchange, body, model, usage, priority_class, arrived
            )
        except asyncio.CancelledError:
            if usage.outcome != "completed":
                usage.outcome = "cancelled"
            raise
        finally:
            self.admission.release(usage)
            self.usage.record(usage)

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


def _json_answer(exchange: Exchange, doc: Any, status: int = 200) -> None:
    exchange.respond(status, json.dumps(doc).encode())
