"""Forwarding an admitted request to a replica, and retrying on another while nothing has
reached the client.

The replica is the ready one with the least outstanding MU (routing.py), with affinity to a
session or a prompt's start. The request is sent on a kept-alive connection (upstream.py) and
its answer relayed as it comes (relay.py, SSE passed through). Before the first byte reaches the
client an attempt may fail (`Retry`): the next replica is tried after a jittered backoff, up to
GATEWAY_RETRIES; a replica that refused the connection costs no retry. A model left without a
replica holds the request again (holding.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from urllib.parse import urlsplit

from capacity.admission.redis_layout import BEST_EFFORT, GUARANTEED

from .contract import ContractReader, Model, Replica
from .errors import GatewayError
from .estimate import CHAT, Body
from .holding import Holding
from .http import ClientGone, Exchange, Request
from .metrics import OVERHEAD, RETRIES, inflight_mu
from .refusals import model_not_ready
from .relay import EngineAnswer, Retry
from .routing import Router
from .settings import Settings
from .upstream import EngineConnection, Engines
from .usage import Usage

log = logging.getLogger("dataplane.gateway")

# vLLM's priority: lower is served first. Forwarded only to engines with priority scheduling.
PRIORITY = {GUARANTEED: 0, BEST_EFFORT: 1}


class Forwarder:
    """One worker's way to the replicas: its router, its connections, its request heads."""

    def __init__(self, settings: Settings, *, reader: ContractReader, holding: Holding) -> None:
        self.settings = settings
        self.reader = reader
        self.holding = holding
        self.router = Router(load_factor=settings.affinity_load_factor)
        self.engines = Engines(connect_timeout_seconds=settings.connect_timeout_seconds)
        # Each replica's (host, port) and each request line with its Host header, built once.
        self._targets: dict[tuple[str, str], tuple[tuple[str, int], bytes]] = {}
        # The header name as http.py keeps it (lower case).
        self._session_header = settings.session_header.lower()

    def close(self) -> None:
        self.engines.close()

    async def serve(
        self,
        request: Request,
        exchange: Exchange,
        body: Body,
        model: Model,
        usage: Usage,
        admission_class: str,
        arrived: float,
    ) -> None:
        """Answer the request from a replica of `model`, retrying on others until one answers
        or the retries are spent (the client then gets a 502, or a 503 while none is ready)."""
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
                current = await self._held_again(current, usage, deadline)
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
                model_not_ready(model, settings).respond(exchange, usage.request_id)
                return
            tried.append(replica.endpoint)
            if replica.priority_scheduling not in payloads:
                payloads[replica.priority_scheduling] = self._payload(
                    body, current, admission_class if replica.priority_scheduling else None
                )
            payload = payloads[replica.priority_scheduling]
            try:
                await self._attempt(exchange, body, replica, payload, usage, arrived, last)
                return
            except Retry as retry:
                last = retry
                log.info("attempt on %s failed before the first byte: %s", replica.endpoint, retry)
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

    async def _held_again(self, model: Model, usage: Usage, deadline: float) -> Model:
        """Admitted while a replica was published, and none is left now: held again, and that
        hold is a cold start too, kept apart from its TTFT."""
        held_from = time.monotonic()
        try:
            return await self.holding.wait_for_replica(model, usage.estimated_mu, deadline)
        finally:
            usage.held_ms = (usage.held_ms or 0.0) + (time.monotonic() - held_from) * 1000.0

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

    async def _attempt(
        self,
        exchange: Exchange,
        body: Body,
        replica: Replica,
        payload: bytes,
        usage: Usage,
        arrived: float,
        last: Retry | None,
    ) -> None:
        """One replica's try, counted in its outstanding MU meanwhile: Retry while nothing
        reached the client. `last`: the previous attempt's failure, if any."""
        usage.deployment = replica.deployment or None
        usage.replica = replica.endpoint
        if last is None:
            OVERHEAD.observe(time.perf_counter() - arrived)
        else:
            RETRIES.inc()  # every attempt after a failed one
        self.router.add(replica.endpoint, usage.estimated_mu)
        gauge = inflight_mu(replica.endpoint)
        gauge.inc(usage.estimated_mu)
        try:
            address, head = self._target(replica.endpoint, body.kind)
            data = head + b"%d\r\n\r\n%b" % (len(payload), payload)
            connection, answer = await self._first_byte(
                address, data, exchange, body, usage, arrived
            )
            try:
                if answer.status != 200 or not body.stream:
                    self._collected(exchange, answer, usage)
                    return
                await answer.finished
            finally:
                if not answer.complete:
                    # Cancelled (the client left, or shutdown): the engine aborts the request.
                    connection.abort()
        finally:
            self.router.done(replica.endpoint, usage.estimated_mu)
            gauge.dec(usage.estimated_mu)

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
