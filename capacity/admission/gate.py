"""Admission control: may this request run, and in which class? (docs/design.md#admission)

`admit(...)` estimates the request's MU, then asks Redis in one round trip (`buckets()`):
the customer's and its key's request limits first (requests and tokens per minute, requests
in flight: capacity.admission.limits), then the MU buckets under the one rule (bucket.split):
what is left of the guaranteed bucket (rate = the customer's reservation), the rest from the
best-effort bucket (rate = the latest tick's allowance), else refused with the time after which
it would fit and the limit that bit. The estimate cannot know the output length, so it takes
`max_tokens` capped by a recent high percentile of the model's output lengths; when the
request's usage event arrives, `reconcile_usage` refunds or charges the difference to the
buckets the request took from, and frees its slot in flight.

Tokens per minute count a request's `input_tokens + max_tokens` (max_tokens after a
degradation cap) at admission, as OpenAI's rate limits count a request's max_tokens: the most
the request may use, known before it runs, and never reconciled.

When Redis cannot be reached, `ADMISSION_ON_REDIS_DOWN` decides: `guaranteed` (default) admits
a customer up to its share of its reservation floor from a bucket in this process and refuses
best-effort; `none` refuses everything. Such answers say `degraded: true` and are counted
in `/metrics`. Request limits live in Redis, so they are not enforced while it is down.

Gateways written in Python call `admit` directly; others call `POST /api/v1/admission`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from capacity.admission.bucket import LocalBuckets
from capacity.admission.floors import floors_of
from capacity.admission.redis_buckets import Buckets
from capacity.admission.redis_layout import (
    BEST_EFFORT,
    GUARANTEED,
    REFUSED,
    REFUSED_GUARANTEED,
    AdmissionRecord,
    AlreadyDecided,
)
from capacity.health.degradation import current as current_degradation
from capacity.health.degradation import forget as forget_degradation
from capacity.health.degradation import refuses_best_effort_of
from capacity.models import (
    CostModel,
    FallbackAdmission,
    ServedModel,
    UsageEvent,
)
from capacity.pricing.cost_models import pricing_cost_model
from capacity.pricing.features import mu_of, replica_seconds_of, uncached_input_tokens
from capacity.telemetry import metrics
from core.errors import DomainError

# vLLM's priority scheduling runs lower values first.
PRIORITY = {GUARANTEED: 0, BEST_EFFORT: 1}
MODEL_CACHE_SECONDS = 60
OUTPUT_SAMPLE = 2000  # recent usage events the output-length percentile is taken over


@dataclass(frozen=True)
class Admission:
    admitted: bool
    admission_class: str
    priority: int | None
    estimated_mu: float
    retry_after_ms: int | None
    limits: dict
    degraded: bool = False
    reason: str = ""
    # Of estimated_mu: the part within the guarantee and the part beyond it (partial
    # spillover: a best-effort request may carry a guaranteed part).
    guaranteed_mu: float = 0.0
    best_effort_mu: float = 0.0
    # Refused: which limit bit ("mu", "rpm", "tpm", "concurrency", "budget": the budget's hard
    # cap) and, for a request limit, whose ("customer" or "api_key").
    limit: str | None = None
    limit_scope: str | None = None
    # Set while the model's healthy capacity is short (capacity.health.degradation): the max_tokens
    # the request must be capped at, the model refused requests should go to, and the level.
    max_tokens: int | None = None
    fallback_model: str | None = None
    degradation_level: int = 0

    def as_dict(self) -> dict:
        body = asdict(self)
        body["class"] = body.pop("admission_class")
        return body


@dataclass
class _ModelInfo:
    model_id: int
    cost_model: CostModel | None
    output_cap_tokens: int | None  # the recent high percentile of output lengths
    loaded_at: float


_models: dict[str, _ModelInfo] = {}
# The fallback while Redis is down: this process's buckets, under the one rule (bucket.py).
_local: LocalBuckets | None = None
_reserved: dict[tuple[int, int], tuple[float, float]] = {}  # -> (MU/min, read at)
_buckets: Buckets | None = None
_buckets_lock = threading.Lock()


def buckets() -> Buckets:
    """The process's admission store client (capacity.admission.redis_buckets.Buckets), made once
    from ADMISSION_REDIS_URL and the admission settings."""
    global _buckets
    if _buckets is None:
        with _buckets_lock:
            if _buckets is None:
                timeout_s = settings.ADMISSION_REDIS_TIMEOUT_MS / 1000.0
                client = redis.Redis.from_url(
                    settings.ADMISSION_REDIS_URL,
                    socket_timeout=timeout_s,
                    socket_connect_timeout=timeout_s,
                )
                _buckets = Buckets(
                    client,
                    burst_seconds=settings.ADMISSION_BURST_SECONDS,
                    idle_ttl_seconds=settings.ADMISSION_LIMITS_TTL_SECONDS,
                    record_ttl_s=settings.ADMISSION_RECORD_TTL_SECONDS,
                    in_flight_ttl_seconds=settings.ADMISSION_CONCURRENCY_TTL_SECONDS,
                    best_effort_fresh_seconds=settings.ADMISSION_TICK_STALE_SECONDS,
                    best_effort_stale_seconds=settings.ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS,
                    unowned_reap_delay_seconds=settings.USAGE_LATENESS_WINDOW_HOURS * 3600,
                )
    return _buckets


def reset() -> None:
    """Forget cached clients, models and fallback buckets (settings changed, tests)."""
    global _buckets
    _buckets = None
    _models.clear()
    if _local is not None:
        _local.clear()
    _reserved.clear()
    forget_degradation()


def output_cap_tokens(model_id: int) -> int | None:
    """The output length admission estimates with when max_tokens is larger: a high percentile
    (ADMISSION_OUTPUT_PERCENTILE) of the model's recent completed outputs; None without any.
    Also published to gateways (capacity.publication)."""
    outputs = list(
        UsageEvent.objects.filter(served_model_id=model_id, outcome="completed")
        .order_by("-finished_at")
        .values_list("output_tokens", flat=True)[:OUTPUT_SAMPLE]
    )
    if not outputs:
        return None
    return int(np.ceil(np.percentile(outputs, settings.ADMISSION_OUTPUT_PERCENTILE)))


def output_caps_tokens(model_ids) -> dict[int, int | None]:
    """`output_cap_tokens` of many models: on PostgreSQL in one round trip (each model's
    recent outputs by the same index scan, through LATERAL), elsewhere one query each."""
    ids = sorted(set(model_ids))
    if connection.vendor != "postgresql" or not ids:
        return {model_id: output_cap_tokens(model_id) for model_id in ids}
    table = UsageEvent._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT m.id, recent.outputs FROM unnest(%s::bigint[]) AS m(id) "  # noqa: S608
            "CROSS JOIN LATERAL (SELECT array_agg(e.output_tokens) AS outputs FROM ("
            f"SELECT output_tokens FROM {table} WHERE served_model_id = m.id "
            "AND outcome = 'completed' ORDER BY finished_at DESC LIMIT %s) AS e) AS recent",
            [ids, OUTPUT_SAMPLE],
        )
        rows = dict(cursor.fetchall())
    return {
        model_id: int(np.ceil(np.percentile(outputs, settings.ADMISSION_OUTPUT_PERCENTILE)))
        if (outputs := rows.get(model_id))
        else None
        for model_id in ids
    }


def _model(name: str) -> _ModelInfo:
    info = _models.get(name)
    if info is not None and time.monotonic() - info.loaded_at < MODEL_CACHE_SECONDS:
        return info
    served = ServedModel.objects.filter(name=name).select_related("reference_gpu_type").first()
    if served is None:
        raise DomainError(f"No model named '{name}'.", field="model")
    try:
        cost_model = pricing_cost_model(served_model=served)
    except DomainError:
        cost_model = None
    info = _ModelInfo(served.pk, cost_model, output_cap_tokens(served.pk), time.monotonic())
    _models[name] = info
    return info


def estimate_mu(info: _ModelInfo, *, input_tokens, cached_input_tokens, max_tokens) -> float:
    """The MU a request is admitted at: its input tokens (cached ones at their price) and max_tokens
    (capped by the model's output cap) under the model's pricing cost model."""
    if info.cost_model is None:
        raise DomainError(
            "This model has no cost model yet, so requests cannot be priced.",
            field="model",
            code="not_priced",
            status=409,
        )
    output = (
        max_tokens if info.output_cap_tokens is None else min(max_tokens, info.output_cap_tokens)
    )
    replica_seconds = replica_seconds_of(
        info.cost_model.weights_replica_seconds,
        input_tokens=uncached_input_tokens(input_tokens, cached_input_tokens),
        cached_input_tokens=cached_input_tokens,
        output_tokens=output,
    )
    return mu_of(replica_seconds, info.cost_model.replica_mu_per_minute)


def admit(
    *,
    customer_id: int,
    model: str,
    input_tokens: int,
    cached_input_tokens: int = 0,
    max_tokens: int,
    request_id: str | None = None,
    api_key_prefix: str | None = None,
    owner: str = "",
) -> Admission:
    """`api_key_prefix`: the customer key the request came with, whose own request limits
    apply beside the customer's (None: the customer's only). `owner`: who asks (a caller of the
    API: "k<its key prefix>"), the only one who may ask again under the same request id, and
    only while it was refused (records are written once)."""
    info = _model(model)
    degradation = current_degradation(info.model_id)
    cap = degradation.max_tokens_cap
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    cost = estimate_mu(
        info,
        input_tokens=input_tokens,
        cached_input_tokens=cached_input_tokens,
        max_tokens=max_tokens,
    )
    # Degradation sheds inside the one decision (the script takes the best-effort bucket away):
    # nothing admitted and recorded is refused afterwards.
    shed = refuses_best_effort_of(degradation, customer_id)
    try:
        decision = buckets().admit(
            customer_id=customer_id,
            model_id=info.model_id,
            cost_mu=cost,
            request_id=request_id,
            tokens=input_tokens + max_tokens,
            api_key_prefix=api_key_prefix,
            shed=shed,
            owner=owner,
        )
    except AlreadyDecided:
        raise DomainError(
            f"The request id '{request_id}' was decided already; admission records are written "
            "once, so its decision stands (send a new id for a new request).",
            field="request_id",
            code="request_id_decided",
            status=409,
        ) from None
    except redis.RedisError:
        return _degraded(
            customer_id, info.model_id, cost, request_id=request_id, api_key_prefix=api_key_prefix
        )
    admission_class = decision.admission_class
    limit = decision.limit
    reason = "" if admission_class != REFUSED else _refusal_reason(decision, degradation)
    admitted = admission_class != REFUSED
    _count(admission_class, admitted)
    wait = decision.retry_after_ms
    return Admission(
        admitted=admitted,
        admission_class=admission_class,
        priority=PRIORITY.get(admission_class),
        estimated_mu=cost,
        retry_after_ms=None if admitted else (int(np.ceil(wait)) if wait >= 0 else None),
        limits={
            "guaranteed_mu_per_minute": decision.guaranteed_mu_per_minute,
            "best_effort_mu_per_minute": decision.best_effort_mu_per_minute,
            "burst_seconds": settings.ADMISSION_BURST_SECONDS,
        },
        reason=reason,
        max_tokens=cap if admitted else None,
        fallback_model=None if admitted else degradation.fallback_model,
        degradation_level=degradation.level,
        guaranteed_mu=decision.guaranteed_mu if admitted else 0.0,
        best_effort_mu=decision.best_effort_mu if admitted else 0.0,
        limit=None if admitted else limit,
        limit_scope=None if admitted else decision.limit_scope,
    )


def _release(customer_id: int, request_id: str | None, api_key_prefix: str | None) -> None:
    if request_id is None:
        return  # its slot lapses with the in-flight TTL
    try:
        buckets().release(
            customer_id=customer_id, request_id=request_id, api_key_prefix=api_key_prefix
        )
    except redis.RedisError:
        metrics.ADMISSION_DEGRADED.inc()


# The counters' label children, looked up once rather than on every decision.
_COUNTERS = {
    (admission_class, admitted): metrics.ADMISSIONS.labels(
        admission_class, "admitted" if admitted else "refused"
    )
    for admission_class in (GUARANTEED, BEST_EFFORT, REFUSED)
    for admitted in (True, False)
}


def _count(admission_class: str, admitted: bool) -> None:
    _COUNTERS[(admission_class, admitted)].inc()


_LIMIT_NAMES = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "concurrency": "requests in flight",
}


def _refusal_reason(decision, degradation) -> str:
    if decision.limit == "degradation":
        tiers = degradation.shed_tiers
        shed = f" for tier(s) {', '.join(tiers)}" if tiers else ""
        return (
            f"best-effort traffic{shed} is refused while the model's healthy capacity is short "
            f"(degradation level {degradation.level}); requests within the reservation are "
            "still admitted"
        )
    if decision.limit == "budget":
        whose = "the API key's" if decision.limit_scope == "api_key" else "the customer's"
        return (
            f"{whose} monthly budget is spent and its hard cap refuses best-effort "
            "requests; requests within the reservation are still admitted"
        )
    if decision.limit in _LIMIT_NAMES:
        whose = "the API key's" if decision.limit_scope == "api_key" else "the customer's"
        return f"over {whose} limit of {_LIMIT_NAMES[decision.limit]} ({decision.limit})"
    if decision.guaranteed_mu_per_minute <= 0 and decision.best_effort_mu_per_minute <= 0:
        return "no reservation and no best-effort allowance for this model"
    return "over the reservation and the best-effort allowance; retry after retry_after_ms"


def _reserved_mu_per_minute(customer_id: int, model_id: int) -> float:
    """The reservation floor now, from what is sold (capacity.admission.floors, never the
    tick's allowance), read at most once per tick interval per (customer, model): an outage
    must not turn every decision into a database query."""
    cached = _reserved.get((customer_id, model_id))
    now = time.monotonic()
    if cached is not None and now - cached[1] < settings.ALLOCATION_TICK_SECONDS:
        return cached[0]
    moment = timezone.now()
    floor = floors_of(now=moment, pairs=[(customer_id, model_id)]).get((customer_id, model_id))
    reserved = floor.at(moment.timestamp() * 1000.0) if floor is not None else 0.0
    _reserved[(customer_id, model_id)] = (reserved, now)
    return reserved


def _degraded(
    customer_id: int,
    model_id: int,
    cost: float,
    *,
    request_id: str | None = None,
    api_key_prefix: str | None = None,
) -> Admission:
    mode = settings.ADMISSION_ON_REDIS_DOWN
    reserved = _reserved_mu_per_minute(customer_id, model_id) if mode == "guaranteed" else 0.0
    limits = {"guaranteed_mu_per_minute": reserved, "best_effort_mu_per_minute": 0.0}
    if mode == "guaranteed" and _take_local(customer_id, model_id, cost, reserved):
        admission_class = GUARANTEED
    else:
        admission_class = REFUSED
    guaranteed_mu = cost if admission_class == GUARANTEED else 0.0
    admitted = admission_class != REFUSED
    _count(admission_class, admitted)
    metrics.ADMISSION_DEGRADED.inc()
    if request_id:
        recorded = admission_class
        if admission_class == REFUSED and reserved > 0:
            recorded = REFUSED_GUARANTEED
        _spool_record(customer_id, model_id, request_id, recorded, cost, api_key_prefix or "")
    return Admission(
        admitted=admitted,
        admission_class=admission_class,
        priority=PRIORITY.get(admission_class),
        estimated_mu=cost,
        retry_after_ms=None if admitted else 1000,
        limits={**limits, "burst_seconds": settings.ADMISSION_BURST_SECONDS},
        degraded=True,
        reason=f"admission store unreachable; ADMISSION_ON_REDIS_DOWN={mode}",
        guaranteed_mu=guaranteed_mu,
        best_effort_mu=0.0,
        limit="mu" if admission_class == REFUSED else None,
    )


def _take_local(customer_id: int, model_id: int, cost: float, reserved: float) -> bool:
    if reserved <= 0:
        return False
    # This process's share: every process that answers admission has such a bucket, so the
    # fleet admits at most the reservation (settings.ADMISSION_FALLBACK_PROCESSES).
    # Best-effort is refused while Redis is down: the rule runs with no best-effort rate, so
    # a request is guaranteed whole (it fits, or the bucket is full) or refused.
    global _local
    if _local is None or _local.burst_seconds != settings.ADMISSION_BURST_SECONDS:
        _local = LocalBuckets(burst_seconds=settings.ADMISSION_BURST_SECONDS)
    decision = _local.split(
        ("g", customer_id, model_id),
        ("be", customer_id, model_id),
        cost_mu=cost,
        guaranteed_mu_per_minute=reserved / settings.ADMISSION_FALLBACK_PROCESSES,
        best_effort_mu_per_minute=0.0,
        now_ms=time.monotonic() * 1000.0,
    )
    return decision.admission_class == GUARANTEED


def _spool_record(
    customer_id: int,
    model_id: int,
    request_id: str,
    recorded_class: str,
    cost: float,
    api_key_prefix: str,
) -> None:
    """Keep the fallback's decision where ingestion will look for it (Redis is down)."""
    FallbackAdmission.objects.update_or_create(
        customer_id=customer_id,
        request_id=request_id,
        defaults={
            "served_model_id": model_id,
            "admission_class": recorded_class,
            "estimated_mu": cost,
            "api_key_prefix": api_key_prefix,
            "decided_at": timezone.now(),
        },
    )


class RecordsUnavailable(DomainError):
    """Admission records cannot be read now: usage cannot be priced; the sender retries."""

    def __init__(self) -> None:
        super().__init__(
            "The admission store cannot be reached, so these events' admission records cannot "
            "be read; nothing was stored. Retry the batch shortly.",
            code="admission_store_unavailable",
            status=503,
        )


def admission_records(
    requests: list[tuple[int, int, str]],
) -> list[AdmissionRecord | None]:
    """The admission record of each (customer id, model id, request id): Redis's, else the
    one the Redis-down fallback spooled, else None. RecordsUnavailable when Redis is down."""
    if not requests:
        return []
    try:
        found = buckets().records(requests)
    except redis.RedisError as error:
        metrics.ADMISSION_DEGRADED.inc()
        raise RecordsUnavailable() from error
    missing = [index for index, record in enumerate(found) if record is None]
    # The spool holds rows only after Redis was down (within the lateness window), so one
    # cheap query spares the usual batch a lookup of thousands of ids (the ORM's building of
    # that IN list was most of ingestion's admission time: py-spy, issue 24).
    if missing and FallbackAdmission.objects.exists():
        spooled = {
            (row.customer_id, row.request_id): row
            for row in FallbackAdmission.objects.filter(
                customer_id__in={requests[i][0] for i in missing},
                request_id__in={requests[i][2] for i in missing},
            )
        }
        for index in missing:
            customer_id, model_id, request_id = requests[index]
            row = spooled.get((customer_id, request_id))
            if row is not None and row.served_model_id == model_id:
                found[index] = AdmissionRecord(
                    row.admission_class,
                    row.estimated_mu,
                    spooled=True,
                    api_key_prefix=row.api_key_prefix,
                )
    return found


def fallback_records_prune() -> int:
    """Forget fallback records older than the usage lateness window (their events are late)."""
    horizon = timezone.now() - timedelta(hours=settings.USAGE_LATENESS_WINDOW_HOURS)
    deleted, _ = FallbackAdmission.objects.filter(decided_at__lt=horizon).delete()
    return deleted


def reconcile_usage(settled: list[tuple[int, int, str, float, str]]) -> None:
    """(customer id, model id, event id, MU used, key prefix of its record or "") of newly
    stored usage events: settle the admission of each request admitted under that id, and free
    the slot in flight it may hold. Best effort: if Redis cannot be reached the estimates
    stand (and the slots lapse with their TTL)."""
    if not settled:
        return
    try:
        store = buckets()
        pipe = store.client.pipeline(transaction=False)
        for customer_id, model_id, event_id, mu, api_key_prefix in settled:
            store.reconcile(
                customer_id=customer_id,
                model_id=model_id,
                request_id=event_id,
                actual_mu=mu,
                api_key_prefix=api_key_prefix or None,
                pipe=pipe,
            )
        pipe.execute()
    except redis.RedisError:
        metrics.ADMISSION_DEGRADED.inc()


def publish_limits(
    allowances,
    previous: set[tuple[int, int]] | None = None,
    *,
    changed: set[tuple[int, int]] | None = None,
) -> None:
    """The tick's allowances into Redis: (customer, model) -> best-effort MU/min, with the
    tick's heartbeat. Pairs the tick no longer gives are deleted; every key expires anyway.
    `changed`:
    the pairs whose stored allowance the tick rewrote; while the last whole publication is
    fresh only those are written (Buckets.publish_limits)."""
    # The best-effort rates only: the guaranteed rate is the reservation floor, written when
    # a sale changes (capacity.admission.floors), so a stalled tick cannot take it away.
    limits = {(a.customer_id, a.model_id): a.best_effort_mu_per_minute for a in allowances}
    try:
        store = buckets()
        store.publish_limits(limits, settings.ADMISSION_LIMITS_TTL_SECONDS, changed=changed)
        if previous:
            store.forget_limits(sorted(previous - set(limits)))
    except redis.RedisError:
        metrics.ADMISSION_DEGRADED.inc()
