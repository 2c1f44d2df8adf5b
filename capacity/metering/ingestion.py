"""Usage metering: idempotent batch ingestion of usage events (docs/design.md#used).

Each event is priced in MU when it arrives, with the model's active reference cost model,
whose id is stored with it so a later re-fit never reprices the past. Event ids are unique per
customer in the database (a unique index), so a retried or concurrent duplicate is reported
as a duplicate and never counted twice. On PostgreSQL a batch is COPYed straight into the table
in a savepoint; if the index refuses it (some event is stored already, or by a concurrent
batch), the batch goes through a staging table with `ON CONFLICT (customer_id, event_id) DO
NOTHING RETURNING` instead. Invalid events are reported by index; the valid events of the same
batch are stored.

A batch arrives either decoded and checked already (`DecodedEvents`, from the msgspec fast
path of capacity.metering.events.decode_batch) or as parsed JSON, checked here with pydantic.

The sender never chooses its own price class. The admission record of the event's id (the
request id admission was asked with) decides it: admitted as guaranteed or best-effort, or
refused (with or without a reservation behind it, or by the customer's own request limits).
It also decides how the event's MU splits between guaranteed and best-effort
(`guaranteed_mu`, `best_effort_mu`; AdmissionRecord.split): a request that took what was left
of the guarantee and spilled the rest to best-effort is billed in both parts. An event without
a record is billed as best-effort and flagged `unrecorded`; one whose outcome or class
contradicts its record is billed by the record and flagged `contradicted`; an event claiming
`refused` for a request admission admitted is rejected, since it would make used capacity free.

The customer key a request came with (`api_key_prefix`, what a key's budget is spent from) is
the record's too: the key admission counted the request under. A sender's `api_key` that
differs from it flags the event `contradicted`; without a record no key is stored, whatever
the sender says.
"""

from dataclasses import dataclass, field
from datetime import datetime, timedelta

import numpy as np
import psycopg
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone
from pydantic import ValidationError

from accounts.models import Customer
from capacity.admission.gate import admission_records, output_caps_tokens, reconcile_usage
from capacity.admission.redis_layout import (
    BEST_EFFORT,
    GUARANTEED,
    REFUSED,
    REFUSED_GUARANTEED,
    REFUSED_LIMIT,
    AdmissionRecord,
)
from capacity.metering.events import (
    CheckedEvent,
    DecodedEvents,
    UsageEventIn,
    context_problems,
    minute_of,
    reasons_from,
)
from capacity.models import (
    AdmissionClass,
    CostModel,
    Deployment,
    Reservation,
    ServedModel,
    UsageEvent,
    Verification,
)
from capacity.pricing.cost_models import active_cost_model
from capacity.pricing.estimates import mu_per_request
from capacity.telemetry import metrics
from core.errors import ConflictError, DomainError

MAX_BATCH_EVENTS = 5_000

COLUMNS = (
    "event_id",
    "customer_id",
    "served_model_id",
    "deployment_id",
    "replica",
    "started_at",
    "finished_at",
    "minute",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "images",
    "outcome",
    "admission_class",
    "verification",
    "self_reported",
    "api_key_prefix",
    "ttft_ms",
    "held_ms",
    "streamed",
    "prompts",
    "sequences",
    "mu",
    "guaranteed_mu",
    "best_effort_mu",
    "estimated_mu",
    "prompt_bytes",
    "cost_model_id",
    "ingested_at",
    "rolled_up",
)
_DATETIME_COLUMNS = tuple(
    COLUMNS.index(name) for name in ("started_at", "finished_at", "minute", "ingested_at")
)


@dataclass
class IngestResult:
    accepted: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "accepted_count": len(self.accepted),
            "duplicate_count": len(self.duplicates),
            "rejected_count": len(self.rejected),
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": self.rejected,
        }


def _mu_per_event(cost_model: CostModel, events: list[CheckedEvent]) -> np.ndarray:
    counts = np.array(
        [
            (e.input_tokens, e.cached_input_tokens, e.output_tokens, e.images,
             e.prompts or 1, e.sequences or 1)
            for e in events
        ],
        dtype=float,
    ).reshape(-1, 6)  # fmt: skip
    several = bool((counts[:, 4:] > 1).any())
    return mu_per_request(
        cost_model,
        input_tokens=counts[:, 0],
        cached_input_tokens=counts[:, 1],
        output_tokens=counts[:, 2],
        images=counts[:, 3],
        # A list of prompts, or n sequences a prompt: priced as the engine ran it.
        prompts=counts[:, 4] if several else None,
        sequences=counts[:, 5] if several else None,
    )


@dataclass(slots=True)
class _Valid:
    """An event that passed the checks, on its way to the table: its index in the batch, the
    rows it names, and (once classified) the class its admission record gives it."""

    index: int
    event: CheckedEvent
    owner: Customer
    model: ServedModel
    cost_model: CostModel
    decided: "_Class | None" = None
    record: AdmissionRecord | None = None


@dataclass
class _Named:
    """The rows a batch names, one query each; active cost models as they are asked for."""

    models: dict[str, ServedModel]
    customers: dict[str, Customer]
    deployments: dict[str, Deployment]
    cost_models: dict[int, CostModel | None] = field(default_factory=dict)

    @classmethod
    def of(cls, parsed: list[tuple[int, CheckedEvent]]) -> "_Named":
        events = [event for _, event in parsed]
        return cls(
            # The reference GPU comes along: the active cost model is looked up by it.
            models={
                model.name: model
                for model in ServedModel.objects.select_related("reference_gpu_type").filter(
                    name__in={event.model for event in events}
                )
            },
            customers={
                c.slug: c
                for c in Customer.objects.filter(
                    slug__in={event.customer for event in events if event.customer}
                )
            },
            deployments={
                d.name: d
                for d in Deployment.objects.filter(
                    name__in={event.deployment for event in events if event.deployment}
                )
            },
        )

    def cost_model_of(self, model: ServedModel) -> CostModel | None:
        if model.pk not in self.cost_models:
            self.cost_models[model.pk] = active_cost_model(served_model=model)
        return self.cost_models[model.pk]


@dataclass(frozen=True)
class _Window:
    """When an event may have finished, and how long it may have run (the settings)."""

    oldest: datetime
    newest: datetime
    longest: timedelta

    @classmethod
    def at(cls, now: datetime) -> "_Window":
        return cls(
            oldest=now - timedelta(hours=settings.USAGE_LATENESS_WINDOW_HOURS),
            newest=now + timedelta(seconds=settings.USAGE_MAX_FUTURE_SECONDS),
            longest=timedelta(hours=settings.USAGE_MAX_DURATION_HOURS),
        )


def usage_ingest(*, events, customer: Customer | None, may_name_customer: bool) -> IngestResult:
    """Store a batch of usage events.

    `customer` is the caller's own customer (a customer key): its events may omit the
    customer and may not name another. A platform key (`may_name_customer`) names it.
    """
    _check_batch(events, customer)
    result = IngestResult()
    now = timezone.now()

    def reject(index: int, reasons: list[str]) -> None:
        # The raw event's id (a checked event's id is the raw one: never stripped).
        raw = events[index]
        event_id = raw.get("event_id") if isinstance(raw, dict) else getattr(raw, "event_id", None)
        result.rejected.append(
            {"index": index, "event_id": event_id if isinstance(event_id, str) else None,
             "reasons": reasons}
        )  # fmt: skip

    parsed = _parsed(events, reject)
    named = _Named.of(parsed)
    window = _Window.at(now)
    seen_in_batch: set[tuple[int, str]] = set()
    valid: list[_Valid] = []
    for index, event in parsed:
        owner, reasons = _owner_of(event, customer, may_name_customer, named)
        model = named.models.get(event.model)
        cost_model = named.cost_model_of(model) if model is not None else None
        reasons += _model_problems(event, model, cost_model)
        reasons += _deployment_problems(event, model, named)
        reasons += _time_problems(event, window)
        if reasons:
            reject(index, reasons)
            continue
        assert owner is not None and model is not None and cost_model is not None
        if (owner.pk, event.event_id) in seen_in_batch:
            result.duplicates.append(event.event_id)
            continue
        seen_in_batch.add((owner.pk, event.event_id))
        valid.append(_Valid(index, event, owner, model, cost_model))

    valid = _classify(valid, reject=reject, platform=customer is None)
    if valid:
        inserted = _store(valid, deployments=named.deployments, now=now, customer=customer)
        for item in valid:
            stored_now = (item.owner.pk, item.event.event_id) in inserted
            (result.accepted if stored_now else result.duplicates).append(item.event.event_id)
        _settle(valid, inserted)
    result.rejected.sort(key=lambda item: item["index"])
    metrics.USAGE_EVENTS.labels("accepted").inc(len(result.accepted))
    metrics.USAGE_EVENTS.labels("duplicate").inc(len(result.duplicates))
    metrics.USAGE_EVENTS.labels("rejected").inc(len(result.rejected))
    return result


def _check_batch(events, customer: Customer | None) -> None:
    """The batch as a whole: a list, not too long, from a caller that may report usage."""
    if not isinstance(events, list):
        raise DomainError("events must be a list of usage events.", field="events")
    if len(events) > MAX_BATCH_EVENTS:
        raise DomainError(
            f"A batch holds at most {MAX_BATCH_EVENTS} events; this one has {len(events)}. "
            "Split it.",
            field="events",
            code="batch_too_large",
            status=413,
        )
    if customer is not None and not customer.may_report_own_usage:
        raise DomainError(
            f"Customer '{customer.slug}' may not report its own usage: usage is what it is "
            "billed on, so only the platform's gateways report it unless a planner allows "
            "the customer to (may_report_own_usage).",
            code="usage_self_report_not_allowed",
            status=403,
        )


def _parsed(events, reject) -> list[tuple[int, CheckedEvent]]:
    """Each event that has the schema, with its index; the others rejected with why."""
    if isinstance(events, DecodedEvents):
        return [(index, event) for index, event in enumerate(events)]  # checked when decoded
    parsed: list[tuple[int, CheckedEvent]] = []
    for index, raw in enumerate(events):
        if not isinstance(raw, dict):
            reject(index, ["an event must be a JSON object"])
            continue
        try:
            parsed.append((index, UsageEventIn.model_validate(raw)))
        except ValidationError as error:
            reject(index, reasons_from(error))
    return parsed


def _owner_of(
    event: CheckedEvent, customer: Customer | None, may_name_customer: bool, named: _Named
) -> tuple[Customer | None, list[str]]:
    """Whose usage the event is: the caller's own customer, or the one a platform key names."""
    if event.customer and customer is not None and event.customer != customer.slug:
        return None, ["customer: a customer's key reports only that customer's usage"]
    if event.customer and not may_name_customer and customer is None:
        return None, ["customer: this key may not report usage"]
    if event.customer:
        owner = named.customers.get(event.customer)
        if owner is None:
            return None, [f"customer: no customer with slug '{event.customer}'"]
        return owner, []
    if customer is None:
        return None, ["customer: required with a platform key"]
    return customer, []


def _model_problems(
    event: CheckedEvent, model: ServedModel | None, cost_model: CostModel | None
) -> list[str]:
    """A known model, priced by an active cost model, within whose context the work fits."""
    if model is None:
        return [f"model: unknown model '{event.model}'"]
    reasons = []
    if cost_model is None:
        reasons.append(
            f"model: '{event.model}' has no active cost model yet, so its usage cannot "
            "be priced; retry the event once one is active"
        )
    problems = context_problems(
        model.context_length_tokens,
        event.input_tokens,
        event.output_tokens,
        prompts=event.prompts or 1,
        sequences=event.sequences or 1,
    )
    reasons.extend(f"{name}: {why[0]}" for name, why in problems.items())
    return reasons


def _deployment_problems(
    event: CheckedEvent, model: ServedModel | None, named: _Named
) -> list[str]:
    """A deployment the event names exists and serves its model."""
    if not event.deployment:
        return []
    deployment = named.deployments.get(event.deployment)
    if deployment is None:
        return [f"deployment: unknown deployment '{event.deployment}'"]
    if model is not None and deployment.served_model_id != model.pk:
        return [f"deployment: '{event.deployment}' does not serve '{event.model}'"]
    return []


def _time_problems(event: CheckedEvent, window: _Window) -> list[str]:
    """Finished inside the lateness window, and started no longer before than a request runs."""
    reasons = []
    if event.finished_at > window.newest:
        reasons.append(
            f"finished_at: more than {settings.USAGE_MAX_FUTURE_SECONDS} s in the future"
        )
    elif event.finished_at < window.oldest:
        reasons.append(
            f"finished_at: older than the lateness window "
            f"({settings.USAGE_LATENESS_WINDOW_HOURS} h)"
        )
    # With finished_at inside the lateness window, this keeps started_at near it too.
    if event.finished_at - event.started_at > window.longest:
        reasons.append(
            f"started_at: more than {settings.USAGE_MAX_DURATION_HOURS} h before "
            "finished_at; no request runs that long"
        )
    return reasons


def _store(
    valid: list[_Valid], *, deployments, now: datetime, customer: Customer | None
) -> dict[tuple[int, str], tuple[int, float]]:
    """Insert the classified events; those stored now, as `_insert` returns them."""
    try:
        return _insert(
            valid,
            deployments=deployments,
            ingested_at=now,
            self_reported=customer is not None,
            demand_estimates=_demand_estimates(valid),
        )
    except (IntegrityError, psycopg.IntegrityError) as error:
        if not _is_reference_violation(error):
            raise
        # A customer, model, deployment or cost model the batch names was deleted between
        # the checks and the insert (the database refuses events that reference a missing
        # row: migration capacity 0035). Nothing of the batch was stored; sent again, its
        # events that name the deleted row are rejected one by one.
        raise ConflictError(
            "A customer, model, deployment or cost model this batch references was deleted "
            "while the batch was stored; nothing of it was stored. Send it again.",
            code="reference_deleted",
        ) from error


def _settle(valid: list[_Valid], inserted: dict[tuple[int, str], tuple[int, float]]) -> None:
    """Only events stored now settle their admission: a duplicate never settles twice. Only
    those with a record in Redis have anything there to settle: a request admitted under its
    id has a record, and its slot in flight (if any) is named by that id; a spooled record
    (Redis was down) took no bucket and no slot."""
    prefixes = {
        (item.owner.pk, item.event.event_id): item.record.api_key_prefix
        for item in valid
        if item.record is not None and not item.record.spooled
    }
    reconcile_usage(
        [(customer_id, model_id, event_id, mu, prefixes[(customer_id, event_id)])
         for (customer_id, event_id), (model_id, mu) in inserted.items()
         if (customer_id, event_id) in prefixes]
    )  # fmt: skip


@dataclass(frozen=True)
class _Class:
    admission_class: str
    verification: str
    # The admitted record whose split the event's MU follows; None: all in admission_class.
    split_by: AdmissionRecord | None = None

    def split(self, mu: float) -> tuple[float, float]:
        """(guaranteed MU, best-effort MU) of an event that used `mu`."""
        if self.split_by is not None:
            return self.split_by.split(mu)
        if self.admission_class == GUARANTEED:
            return mu, 0.0
        if self.admission_class == BEST_EFFORT:
            return 0.0, mu
        return 0.0, 0.0


def _class_of(event: CheckedEvent, record: AdmissionRecord | None) -> _Class | str:
    """The class an event is billed in, from its admission record; or why it is rejected."""
    if record is None:
        # Nothing says admission let this request in: it ran (if it ran) on slack.
        return _Class(BEST_EFFORT, Verification.UNRECORDED)
    if record.fallback_contradicted:
        # A fallback's guaranteed class for a customer that held no reservation then: what
        # ran is best-effort, what was refused best-effort demand (no credit).
        return _Class(BEST_EFFORT, Verification.CONTRADICTED)
    verified = Verification.FALLBACK if record.spooled else Verification.RECORDED
    if record.admitted:
        if event.outcome == "refused":
            return (
                f"outcome: admission admitted request '{event.event_id}' as "
                f"{record.admission_class}; report what happened to it (completed, cancelled "
                "or error), not refused"
            )
        claimed = event.admission_class
        agrees = claimed in (None, record.admission_class) and _same_key(event, record)
        return _Class(
            record.admission_class,
            verified if agrees else Verification.CONTRADICTED,
            split_by=record,
        )
    # Refused by admission: by the MU buckets in the guaranteed or best-effort class, or by the
    # customer's own request limits (neither: no SLA credit, and no demand for capacity).
    refused_class = {REFUSED_GUARANTEED: GUARANTEED, REFUSED_LIMIT: AdmissionClass.NONE}.get(
        record.admission_class, BEST_EFFORT
    )
    if event.outcome != "refused":
        # It ran although admission refused it: billed as best-effort, flagged.
        return _Class(BEST_EFFORT, Verification.CONTRADICTED)
    claimed = event.admission_class
    agrees = claimed in (None, refused_class) and _same_key(event, record)
    return _Class(refused_class, verified if agrees else Verification.CONTRADICTED)


def _same_key(event: CheckedEvent, record: AdmissionRecord) -> bool:
    """The sender's key agrees with the record's (or the sender names none)."""
    return event.api_key is None or event.api_key == record.api_key_prefix


# What a gateway's Redis-down fallback decided, as the record it would have left.
_FALLBACK_RECORD_CLASSES = {
    "guaranteed": GUARANTEED,
    "refused_guaranteed": REFUSED_GUARANTEED,
    "refused": REFUSED,
}


def _fallback_records(valid: list[_Valid], records: list, *, platform: bool) -> list:
    """Where no admission record exists, what the gateway's own fallback decided while Redis
    could not be reached (`fallback_class`), as a spooled record: from a platform key only (a
    customer's own report never picks its class), and a guaranteed class only for a customer
    that held a reservation of the model when the request started (else the claim
    contradicts what was sold: billed as best-effort, flagged)."""
    claims = [
        position
        for position, (item, record) in enumerate(zip(valid, records, strict=True))
        if record is None and platform and item.event.fallback_class is not None
    ]
    if not claims:
        return records
    pairs = {(valid[p].owner.pk, valid[p].model.pk) for p in claims}
    terms: dict[tuple[int, int], list] = {}
    wanted = Q()
    for customer_id, model_id in pairs:
        wanted |= Q(customer_id=customer_id, served_model_id=model_id)
    for customer_id, model_id, starts_at, ends_at in (
        Reservation.objects.not_cancelled()
        .filter(wanted)
        .values_list("customer_id", "served_model_id", "starts_at", "ends_at")
    ):
        terms.setdefault((customer_id, model_id), []).append((starts_at, ends_at))
    records = list(records)
    for position in claims:
        event, owner, model = valid[position].event, valid[position].owner, valid[position].model
        assert event.fallback_class is not None  # a claim holds one
        claimed = _FALLBACK_RECORD_CLASSES[event.fallback_class]
        reserved = any(
            starts <= event.started_at and (ends is None or ends > event.started_at)
            for starts, ends in terms.get((owner.pk, model.pk), ())
        )
        records[position] = AdmissionRecord(
            claimed,
            float(event.estimated_mu or 0.0),
            spooled=True,
            # The key the gateway authenticated the request with (a platform key's word, as
            # its decision is): what the key's budget spends.
            api_key_prefix=event.api_key or "",
            fallback_contradicted=claimed != REFUSED and not reserved,
        )
    return records


def _classify(valid: list[_Valid], *, reject, platform: bool) -> list[_Valid]:
    """Each valid event with the class its admission record gives it (or, without one, its
    gateway's Redis-down fallback: `_fallback_records`); events that contradict their record
    in a way that cannot be billed are rejected."""
    records = admission_records(
        [(item.owner.pk, item.model.pk, item.event.event_id) for item in valid]
    )
    records = _fallback_records(valid, records, platform=platform)
    classified = []
    for item, record in zip(valid, records, strict=True):
        decided = _class_of(item.event, record)
        if isinstance(decided, str):
            reject(item.index, [decided])
            continue
        item.decided, item.record = decided, record
        classified.append(item)
    return classified


def _demand_estimates(valid: list[_Valid]) -> dict[int, float]:
    """What a refused request without an admission record counts as demand, by its position in
    `valid`: what the sender says (`estimated_mu`), at most the control plane's own estimate of
    it, its input tokens plus the output cap admission estimates with
    (capacity.admission.gate.output_caps_tokens; none yet: its input alone). One forged event
    must not drive the fleet. Without a sender's figure, no demand (as before)."""
    positions = [
        position
        for position, item in enumerate(valid)
        if item.event.outcome == "refused"
        and item.record is None
        and item.event.estimated_mu is not None
    ]
    if not positions:
        return {}
    caps = output_caps_tokens({valid[p].model.pk for p in positions})
    estimates = {}
    for position in positions:
        event, model, cost_model = (
            valid[position].event,
            valid[position].model,
            valid[position].cost_model,
        )
        prompts = event.prompts or 1
        sequences = event.sequences or 1
        cap = caps.get(model.pk) or 0
        own = float(
            mu_per_request(
                cost_model,
                input_tokens=np.array([event.input_tokens], dtype=float),
                cached_input_tokens=np.array([event.cached_input_tokens], dtype=float),
                output_tokens=np.array([cap * sequences], dtype=float),
                images=np.array([event.images], dtype=float),
                prompts=np.array([prompts], dtype=float),
                sequences=np.array([sequences], dtype=float),
            )[0]
        )
        estimates[position] = min(own, float(event.estimated_mu or 0.0))
    return estimates


def _engine_refused(event: CheckedEvent, self_reported: bool) -> bool:
    """An error the engine answered before any work (a 4xx), as a platform's gateway says:
    nothing ran, nothing is billed. A customer's own report of it is not taken."""
    return event.engine_status is not None and event.outcome == "error" and not self_reported


def _rows(
    valid: list[_Valid], *, deployments, ingested_at, self_reported: bool, demand_estimates=None
):
    """Each classified event as a row of COLUMNS, priced per cost model in one pass."""
    by_cost_model: dict[int, list[int]] = {}
    for position, item in enumerate(valid):
        by_cost_model.setdefault(item.cost_model.pk, []).append(position)
    mu = np.zeros(len(valid))
    for positions in by_cost_model.values():
        cost_model = valid[positions[0]].cost_model
        mu[positions] = _mu_per_event(cost_model, [valid[p].event for p in positions])
    for position, item in enumerate(valid):
        event, owner, model, cost_model = item.event, item.owner, item.model, item.cost_model
        decided, record = item.decided, item.record
        assert decided is not None  # classified
        deployment = deployments.get(event.deployment) if event.deployment else None
        # A refused request never ran, nor one the engine refused before any work: it used
        # nothing.
        nothing = event.outcome == "refused" or _engine_refused(event, self_reported)
        used = 0.0 if nothing else float(mu[position])
        guaranteed_mu, best_effort_mu = decided.split(used)
        yield (
            event.event_id,
            owner.pk,
            model.pk,
            deployment.pk if deployment else None,
            event.replica or "",
            event.started_at,
            event.finished_at,
            minute_of(event.finished_at),
            event.input_tokens,
            event.cached_input_tokens,
            event.output_tokens,
            event.images,
            event.outcome,
            decided.admission_class,
            decided.verification,
            self_reported,
            # The key admission recorded, never the sender's claim.
            record.api_key_prefix if record is not None else "",
            # A non-streamed answer's first byte is its end: no TTFT (billing.latency counts it
            # apart as a request without one).
            None if event.streamed is False else event.ttft_ms,
            event.held_ms,
            event.streamed,
            event.prompts,
            event.sequences,
            used,
            guaranteed_mu,
            best_effort_mu,
            _refused_estimate(event, record, (demand_estimates or {}).get(position)),
            # A refused request never reached an engine: its tokens are estimates, not counts.
            None if event.outcome == "refused" else event.prompt_bytes,
            cost_model.pk,
            ingested_at,
            False,
        )


def _refused_estimate(
    event: CheckedEvent, record: AdmissionRecord | None, own: float | None
) -> float | None:
    """What a refused request would have cost: the control plane's own estimate in its
    admission record, else its own estimate from the event (`_demand_estimates`, never above
    the sender's); None for a request that ran."""
    if event.outcome != "refused":
        return None
    if record is not None:
        return float(record.estimated_mu)
    return own


_MU = COLUMNS.index("mu")
# The PostgreSQL type (oid) of each of COLUMNS, read once per process: binary COPY needs them.
_column_types: list[int] = []


def _copy(cursor, table: str, rows) -> None:
    """COPY the rows into `table` in binary: psycopg's compiled dumpers write them, and the
    server reads numbers and instants without parsing text (the text format's write_row was
    the largest item of the worker's own time after the decode; py-spy, issue 24)."""
    if not _column_types:
        cursor.execute(
            "SELECT attname, atttypid FROM pg_attribute WHERE attrelid = %s::regclass",
            [UsageEvent._meta.db_table],
        )
        types = dict(cursor.fetchall())
        _column_types[:] = [types[name] for name in COLUMNS]
    with cursor.cursor.copy(
        f"COPY {table} ({', '.join(COLUMNS)}) FROM STDIN (FORMAT BINARY)"
    ) as copy:
        copy.set_types(_column_types)
        for row in rows:
            copy.write_row(row)


def _is_reference_violation(error: Exception) -> bool:
    """The usage table's reference checks refused a row: SQLSTATE 23503 on PostgreSQL (raised
    by psycopg itself from a COPY, wrapped by Django from an INSERT), the SQLite trigger's
    message there."""
    violation = psycopg.errors.ForeignKeyViolation
    if isinstance(error, violation) or isinstance(error.__cause__, violation):
        return True
    return "FOREIGN KEY constraint failed" in str(error)


def _insert(
    valid, *, deployments, ingested_at, self_reported: bool, demand_estimates=None
) -> dict[tuple[int, str], tuple[int, float]]:
    """Store the events; return those stored now (not known before) as (customer id, event
    id) -> (model id, MU)."""
    rows = list(
        _rows(
            valid,
            deployments=deployments,
            ingested_at=ingested_at,
            self_reported=self_reported,
            demand_estimates=demand_estimates,
        )
    )
    stored = usage_rows_insert(rows)
    return {(row[1], row[0]): (row[2], row[_MU]) for row in rows if (row[1], row[0]) in stored}


@transaction.atomic
def usage_rows_insert(rows) -> set[tuple[int, str]]:
    """Insert the rows, skipping (customer, event id)s already stored; return the (customer
    id, event id)s stored now."""
    table = UsageEvent._meta.db_table
    columns = ", ".join(COLUMNS)
    if connection.vendor == "postgresql":
        # Most batches are new: COPY them straight into the table, which is about half the
        # database's work of the path below (and no second copy of every row). The unique
        # (customer, event id) index still decides: a batch holding any event stored before,
        # or by a concurrent batch, fails as a whole and is rolled back to the savepoint.
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                _copy(cursor, table, rows)
            return {(row[1], row[0]) for row in rows}
        except psycopg.errors.UniqueViolation:
            pass
        # COPY the batch into a per-connection staging table (emptied at commit), then move
        # it over in one statement that skips known event ids and returns the ones it stored.
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE TEMP TABLE IF NOT EXISTS usage_staging ON COMMIT DELETE ROWS AS "  # noqa: S608
                f"SELECT {columns} FROM {table} WITH NO DATA"
            )
            _copy(cursor, "usage_staging", rows)
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT {columns} FROM usage_staging "  # noqa: S608
                "ON CONFLICT (customer_id, event_id) DO NOTHING RETURNING customer_id, event_id"
            )
            return {(row[0], row[1]) for row in cursor.fetchall()}
    placeholders = ", ".join(["%s"] * len(COLUMNS))
    sql = (
        f"INSERT INTO {table} ({columns}) VALUES ({placeholders}) "  # noqa: S608
        "ON CONFLICT (customer_id, event_id) DO NOTHING RETURNING customer_id, event_id"
    )
    inserted = set()
    adapt = connection.ops.adapt_datetimefield_value
    with connection.cursor() as cursor:
        for row in rows:
            # Raw SQL skips the ORM's conversion of datetimes to the text SQLite stores (UTC,
            # no offset): without it the stored text never equals what lookups compare with,
            # and rollups, utilisation and billing would read nothing.
            values = list(row)
            for position in _DATETIME_COLUMNS:
                values[position] = adapt(values[position])
            cursor.execute(sql, values)
            inserted.update((r[0], r[1]) for r in cursor.fetchall())
    return inserted
