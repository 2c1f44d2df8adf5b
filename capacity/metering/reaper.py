"""The reaper: every request leaves exactly one usage event, even one whose gateway worker died
holding its event in memory (docs/design.md#fail-safe).

Every admission decision made under a request id joins Redis's index of open requests
(`adm:open`, capacity.admission.redis_buckets) until its usage event settles it. A gateway
worker names itself in the decisions it asks for (the record's owner) and keeps a heartbeat in
`gw:v1:workers`. The reaper (`usage_reap`, Celery's `capacity.usage_reap` on the `allocation`
queue, every minute) closes the requests still open `USAGE_REAP_GRACE_SECONDS` after they were
decided whose worker has not been seen alive for as long:

- an admitted request becomes a `cancelled` event at 0 MU in its class, `verification:
  reaped`, and its admission is settled at 0 (the estimate refunded, its slot freed);
- a refused one becomes its `refused` event (the demand it was, with the record's estimate).

A request decided for a caller of `POST /api/v1/admission` (no worker's heartbeat behind it)
is looked at once the usage lateness window is over: no event of it can be accepted after
that. A worker that is alive keeps its requests open however long they stream. Nothing is
reaped while the usage spool (`gw:v1:spool`) holds batches: their events are on their way.

A reaped event is final: a real event arriving later for the same id is a duplicate (the
grace, minutes past the last heartbeat, is what keeps that from happening but for a worker cut
off from Redis and the control plane at once for that long).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from django.conf import settings
from django.utils import timezone

from capacity.admission.gate import buckets, reconcile_usage
from capacity.admission.gateways import SPOOL, WORKERS
from capacity.admission.redis_layout import (
    BEST_EFFORT,
    GUARANTEED,
    OPEN_REQUESTS_KEY,
    REFUSED_GUARANTEED,
    REFUSED_LIMIT,
    WORKER_OWNER_PREFIX,
    AdmissionRecord,
    parse_open_member,
)
from capacity.metering.events import minute_of
from capacity.metering.ingestion import COLUMNS, usage_rows_insert
from capacity.models import AdmissionClass, Outcome, ServedModel, UsageEvent, Verification
from capacity.pricing.cost_models import pricing_cost_model
from core.errors import DomainError

logger = logging.getLogger(__name__)

CHUNK = 1000
MAX_PER_PASS = 20_000

# The class a reaped event is stored in, from its record.
_CLASS_OF_RECORD = {
    GUARANTEED: AdmissionClass.GUARANTEED,
    BEST_EFFORT: AdmissionClass.BEST_EFFORT,
    REFUSED_GUARANTEED: AdmissionClass.GUARANTEED,
    REFUSED_LIMIT: AdmissionClass.NONE,
}


def usage_reap(*, now_ms: float | None = None) -> dict:
    """One pass; what it found and did."""
    store = buckets()
    client = store.client
    if client.xlen(SPOOL):
        return {"skipped": "usage spool not empty", "reaped": 0, "closed": 0}
    now_ms = time.time() * 1000.0 if now_ms is None else now_ms
    grace_ms = settings.USAGE_REAP_GRACE_SECONDS * 1000.0
    alive = {
        (owner.decode() if isinstance(owner, bytes) else owner): float(at)
        for owner, at in client.hgetall(WORKERS).items()
    }
    reaped = closed = kept = 0
    seen = 0
    start = 0
    while seen < MAX_PER_PASS:
        rows = client.zrangebyscore(
            OPEN_REQUESTS_KEY, "-inf", now_ms - grace_ms, start=start, num=CHUNK, withscores=True
        )
        if not rows:
            break
        seen += len(rows)
        done, gone, skipped = _pass(store, rows, alive, now_ms=now_ms, grace_ms=grace_ms)
        reaped += done
        closed += gone
        kept += skipped
        # Closed members left the index; the kept ones are stepped over.
        start += skipped
        if len(rows) < CHUNK:
            break
    if reaped:
        logger.warning("reaper: %d request(s) closed with no event from their gateway", reaped)
    return {"reaped": reaped, "closed": closed, "kept": kept}


def _pass(store, rows, alive: dict[str, float], *, now_ms: float, grace_ms: float):
    members = [(m.decode() if isinstance(m, bytes) else m, float(at)) for m, at in rows]
    parsed = [parse_open_member(member) for member, _ in members]
    records = store.records([p for p in parsed if p is not None])
    by_member: dict[str, AdmissionRecord | None] = {}
    readable = iter(records)
    for (member, _), found in zip(members, parsed, strict=True):
        by_member[member] = next(readable) if found is not None else None
    close: list[str] = []
    due: list[tuple[str, tuple[int, int, str], AdmissionRecord, float]] = []
    kept = 0
    lateness_ms = settings.USAGE_LATENESS_WINDOW_HOURS * 3600 * 1000.0
    for (member, due_at), found in zip(members, parsed, strict=True):
        record = by_member[member]
        if found is None or record is None or record.settled:
            close.append(member)  # expired, unreadable, or its event came
            continue
        if record.owner.startswith(WORKER_OWNER_PREFIX):
            seen_at = alive.get(record.owner)
            if seen_at is not None and seen_at > now_ms - grace_ms:
                kept += 1  # its worker lives: a long request, its event still due
                continue
            decided_at = due_at
        else:
            decided_at = due_at - lateness_ms
        due.append((member, found, record, decided_at))
    reaped = _reap(due)
    store.close_open(close + [member for member, *_ in due])
    return reaped, len(close), kept


def _reap(due) -> int:
    """Store the events of `due` that no event exists for, settle the admitted ones at 0."""
    if not due:
        return 0
    existing = set(
        UsageEvent.objects.filter(
            customer_id__in={c for _, (c, _, _), _, _ in due},
            event_id__in={r for _, (_, _, r), _, _ in due},
        ).values_list("customer_id", "event_id")
    )
    models = {
        m.pk: m
        for m in ServedModel.objects.select_related("reference_gpu_type").filter(
            pk__in={m for _, (_, m, _), _, _ in due}
        )
    }
    cost_models = {}
    for model_id, model in models.items():
        try:
            cost_models[model_id] = pricing_cost_model(served_model=model)
        except DomainError:
            logger.error("reaper: model %s has no cost model; its requests stay open", model)
    now = timezone.now()
    rows = []
    settle = []
    for _, (customer_id, model_id, request_id), record, decided_at in due:
        if (customer_id, request_id) in existing or model_id not in cost_models:
            continue
        moment = datetime.fromtimestamp(decided_at / 1000.0, tz=UTC)
        refused = not record.admitted
        values = {
            "event_id": request_id,
            "customer_id": customer_id,
            "served_model_id": model_id,
            "deployment_id": None,
            "replica": "",
            "started_at": moment,
            "finished_at": moment,
            "minute": minute_of(moment),
            "input_tokens": 0,
            "cached_input_tokens": 0,
            "output_tokens": 0,
            "images": 0,
            "outcome": Outcome.REFUSED if refused else Outcome.CANCELLED,
            "admission_class": _CLASS_OF_RECORD.get(
                record.admission_class, AdmissionClass.BEST_EFFORT
            ),
            "verification": Verification.REAPED,
            "self_reported": False,
            "api_key_prefix": record.api_key_prefix,
            "ttft_ms": None,
            "held_ms": None,
            "streamed": None,
            "prompts": None,
            "sequences": None,
            "mu": 0.0,
            "guaranteed_mu": 0.0,
            "best_effort_mu": 0.0,
            "estimated_mu": float(record.estimated_mu) if refused else None,
            "prompt_bytes": None,
            "cost_model_id": cost_models[model_id].pk,
            "ingested_at": now,
            "rolled_up": False,
        }
        rows.append(tuple(values[name] for name in COLUMNS))
        if not refused:
            settle.append((customer_id, model_id, request_id, 0.0, record.api_key_prefix))
    stored = usage_rows_insert(rows) if rows else set()
    # Settled at 0: the estimate goes back to the buckets, the slot in flight is freed.
    reconcile_usage([item for item in settle if (item[0], item[2]) in stored])
    return len(stored)
