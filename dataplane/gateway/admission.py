"""Admission at the gateway: may this request run now, and in which class.

One Redis round trip decides (`capacity.admission.redis_buckets.AsyncBuckets`, the control
plane's own Lua script: the customer's and its key's request limits, then the MU buckets).
Before it, a request for a model at zero is held until a replica is published (holding.py);
after a refusal, the model's degradation fallback is asked in its place. While Redis cannot be
reached, this worker decides alone from its share of each customer's reservation, best-effort
refused (`capacity.admission.bucket.LocalBuckets`), and says so in the usage event.

Whatever stage a request ends in, it leaves exactly one usage event: the events of requests
that end during admission (the client gone, an error) are decided here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from capacity.admission.bucket import LocalBuckets
from capacity.admission.redis_async import AsyncBuckets
from capacity.admission.redis_layout import (
    BEST_EFFORT,
    GUARANTEED,
    REFUSED,
    REFUSED_GUARANTEED,
    BucketDecision,
)

from .auth import Caller, may_use
from .contract import Contract, ContractReader, Model
from .estimate import Body, estimate_mu, input_tokens_of, max_output_tokens_of, output_tokens_of
from .holding import Holding
from .metrics import FALLBACK_DECISIONS
from .settings import Settings
from .usage import Usage, UsageSink

log = logging.getLogger("dataplane.gateway")

# A request held for a model that just woke asks admission again this often while the first
# allowances of the new replica are on their way.
ADMISSION_RETRY_SECONDS = 0.5


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    """A release's answer: nothing to do with it (a Redis error is logged, the slot lapses)."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("freeing a concurrency slot failed: %s", future.exception())


class Admission:
    """One worker's admission: its pipeline to the Redis buckets and its own fallback buckets."""

    def __init__(
        self,
        settings: Settings,
        *,
        redis: aioredis.Redis,
        reader: ContractReader,
        holding: Holding,
        sink: UsageSink,
        owner: str,
    ) -> None:
        self.settings = settings
        self.reader = reader
        self.holding = holding
        self.sink = sink  # where each request's one usage event goes
        # Who answers the requests this worker admits, in their admission records.
        self.owner = owner
        # The control plane's own Lua script, on a connection of its own that pipelines the
        # decisions asked for while one round trip is under way.
        self.buckets = AsyncBuckets(
            redis,
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
        self._parameters_from: Contract | None = None

    async def close(self) -> None:
        await self.buckets.close()

    # -- one request ----------------------------------------------------------------------

    async def admit(
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
            usage = self._usage_of(candidate, caller, body, request_id, started_at)
            pending.append(usage)
            candidate, admission_class, retry_after_ms = await self._ask(caller, candidate, usage)
            if usage.extra.get("not_ready"):
                usage.outcome = "refused"
                return candidate, usage, REFUSED
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
        """The model a degraded one sends its refused requests to, when the caller may use it."""
        name = model.degradation.fallback_model
        if not name or name == model.name or not may_use(contract, caller, name):
            return None
        return contract.models.get(name)

    def _usage_of(
        self, model: Model, caller: Caller, body: Body, request_id: str, started_at: float
    ) -> Usage:
        """The request's usage as `model` would serve it: its tokens under the model's
        degraded cap, and its MU estimate, which admission charges."""
        cap = model.degradation.max_tokens_cap
        if cap is not None and (body.max_tokens is None or body.max_tokens > cap):
            body.max_tokens = cap
        input_tokens = input_tokens_of(body, model)
        limit_tokens = input_tokens + max_output_tokens_of(body, model, input_tokens)
        mu = estimate_mu(
            model,
            input_tokens=input_tokens,
            output_tokens=output_tokens_of(body, model, input_tokens),
            images=body.images,
            prompts=body.prompts,
            sequences=body.sequences,
        )
        return Usage(
            request_id=request_id,
            customer=caller.customer,
            model=model.name,
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

    async def _ask(self, caller: Caller, model: Model, usage: Usage) -> tuple[Model, str, float]:
        """(the model as published when decided, the admission class, retry after ms).

        A model at zero holds the request before admission, as Knative's activator does, since
        admission would lend it nothing until a replica is ready; the waiting demand and a
        wake-up ask the loop for one now. No replica by the end of the hold: refused, marked
        `not_ready`."""
        if model.replicas:
            admission_class, retry_after_ms = await self._decide(caller, model, usage)
            return model, admission_class, retry_after_ms
        held_from = time.monotonic()
        held_until = held_from + self.settings.cold_start_wait_seconds
        try:
            model = await self.holding.wait_for_replica(model, usage.estimated_mu, held_until)
            if not model.replicas:
                usage.extra["not_ready"] = True
                return model, REFUSED, -1.0
            admission_class, retry_after_ms = await self._decide(caller, model, usage)
            while admission_class == REFUSED:
                # The model just woke: its first allowances follow the tick that readiness
                # triggers. Ask again until they do, within what is left of the hold.
                if time.monotonic() + ADMISSION_RETRY_SECONDS >= held_until:
                    break
                await asyncio.sleep(ADMISSION_RETRY_SECONDS)
                admission_class, retry_after_ms = await self._decide(caller, model, usage)
            return model, admission_class, retry_after_ms
        finally:
            # The cold start it waited through, kept apart from its TTFT (which counts from
            # here): the SLA counts it only where the customer keeps warm.
            usage.held_ms = (time.monotonic() - held_from) * 1000.0

    async def _decide(self, caller: Caller, model: Model, usage: Usage) -> tuple[str, float]:
        """(admission class, retry after ms) from the Redis buckets, one round trip; from this
        worker's share of the reservation while Redis cannot be reached."""
        if time.monotonic() < self._redis_down_until:
            return self._without_redis(model, usage)
        self._follow_parameters()
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
            orphaned=lambda outcome: self._left_while_deciding(outcome, usage),
            # Degradation sheds in the same decision (the script takes the best-effort bucket
            # away): nothing Redis admits and records is refused afterwards.
            shed=model.degradation.refuses_best_effort_of(tier),
            owner=self.owner,
        )
        # Until Redis answers, its event is the decision's to leave (`orphaned` above), not
        # the abandoning handler's (`abandoned`).
        usage.extra["deciding"] = True
        try:
            decision = await pending
        except asyncio.CancelledError:
            if pending.done() and not pending.cancelled():  # decided just before
                outcome = pending.exception() or pending.result()
                self._left_while_deciding(outcome, usage)
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

    def _follow_parameters(self) -> None:
        """The control plane's burst and TTLs when it published them (gw:v1:meta), else the
        GATEWAY_ADMISSION_* settings: the same rule with the same burst as the API's admission.
        Read again only when a new contract was read."""
        contract = self.reader.contract
        if contract is self._parameters_from:
            return
        self._parameters_from = contract
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

    # -- the ends of a request ------------------------------------------------------------

    def release(self, usage: Usage) -> None:
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

    def abandoned(self, usage: Usage) -> None:
        """The event of a request that ended before it was forwarded: cancelled in its class
        when it was admitted, refused when its last decision refused it, and cancelled with no
        class when it was never decided (held for a cold start all along). One whose decision is
        still on its way from Redis leaves its event when the decision comes (`orphaned`)."""
        if usage.extra.get("deciding"):
            return
        if usage.admission_class in (GUARANTEED, BEST_EFFORT):
            usage.outcome = "cancelled"
            self.release(usage)
        elif usage.extra.get("decided"):
            usage.outcome = "refused"
            usage.admission_class = None
        else:
            usage.outcome = "cancelled"
        self.sink.record(usage)

    def _left_while_deciding(self, outcome: BucketDecision | BaseException, usage: Usage) -> None:
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
        self.sink.record(usage)
