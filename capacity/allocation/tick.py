"""The allocation tick: snapshot from the database → the policy → decisions stored → targets
applied through actuators (DESIGN §2). Run every 15 s by Celery beat.

One tick runs at a time across all workers: a PostgreSQL advisory lock (a Redis lock on the
SQLite demo database); a tick that finds it taken skips. Actuators are called outside any
database transaction and only with this tick's targets, so a failed push is never re-applied
later: the next tick decides afresh. Repeated failures open a circuit for the deployment.
Pushes run concurrently, each within ALLOCATION_PUSH_DEADLINE_SECONDS: one that misses it is a
failure on its decision, and the tick (which holds the lock) does not wait for it.
"""

import hashlib
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta

import numpy as np
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max, Q, Sum
from django.db.models.functions import Trunc
from django.utils import timezone

from capacity.actuation.base import Actuator, ActuatorResult, ScaleRequest, apply_with_retries
from capacity.admission.gate import publish_limits
from capacity.allocation import policy as allocation
from capacity.allocation.bursts import Bursts, bursts
from capacity.health.probes import unhealthy_replicas_by_deployment
from capacity.metering.history import record_capacity
from capacity.models import (
    ActuatorCircuit,
    AdmissionAllowance,
    AllocationDecision,
    CostModel,
    Deployment,
    GpuPool,
    Reservation,
    UsageEvent,
    UsageMinute,
)
from capacity.pricing.exchange import DEFAULT_MIX, MeanShape
from capacity.pricing.exchange import replica_mu_per_minute as exchange_rate
from capacity.selling.sellable import MIX_LOOKBACK
from capacity.telemetry import metrics
from controlplane.db import Lock, copy_upsert, exclusive

logger = logging.getLogger(__name__)

RECENT_WINDOW = timedelta(seconds=allocation.RECENT_WINDOW_SECONDS)
PEAK_WINDOW = timedelta(seconds=allocation.PEAK_WINDOW_SECONDS)
BURST_WINDOW = timedelta(seconds=allocation.BURST_WINDOW_SECONDS)
NO_BURSTS = Bursts(0.0, 0.0)
IDLE_LOOKBACK = timedelta(days=1)
CIRCUIT_THRESHOLD = 3
CIRCUIT_BASE_SECONDS = 60
CIRCUIT_MAX_SECONDS = 900
ACTUATOR_THREADS = 16


@dataclass
class TickResult:
    tick_id: str
    skipped: bool = False
    dry_run: bool = False
    seconds: float = 0.0
    decisions: list[dict] = field(default_factory=list)
    allowances: list[dict] | int = field(default_factory=list)  # dry run: rows; else: count
    models: list[dict] = field(default_factory=list)
    applied: int = 0
    failed: int = 0


# --- Snapshot --------------------------------------------------------------------------------


def _replica_mu(reference: CostModel | None, own: CostModel | None, mix: MeanShape) -> float | None:
    if reference is None or own is None:
        return None
    return exchange_rate(reference=reference, own=own, mix=mix)


def build_snapshot(*, now: datetime, window_seconds: float | None = None):
    """The policy's input, in a fixed number of queries whatever the fleet size."""
    window_seconds = window_seconds or settings.ALLOCATION_STABILISATION_SECONDS
    deployments = list(
        Deployment.objects.select_related("served_model", "gpu_pool__gpu_type").order_by("pk")
    )
    # Replicas the probes found unhealthy are being restarted: they hold their GPUs but serve
    # nothing, so the policy plans without them (and `with_replacements` adds them back).
    unhealthy = unhealthy_replicas_by_deployment()
    held_gpus: dict[int, int] = defaultdict(int)
    for d in deployments:
        held_gpus[d.gpu_pool_id] += min(unhealthy.get(d.pk, 0), d.current_replicas) * (
            d.gpus_per_replica
        )
    pools = [
        allocation.PoolState(pool.pk, pool.name, max(0, pool.gpu_count - held_gpus[pool.pk]))
        for pool in GpuPool.objects.all()
    ]
    active = {
        (c.served_model_id, c.gpu_type_id, c.gpus_per_replica): c
        for c in CostModel.objects.filter(status=CostModel.Status.ACTIVE)
    }
    # The reference cost model: the model's reference GPU type, fewest GPUs per replica.
    served_models = {d.served_model_id: d.served_model for d in deployments}
    references: dict[int, CostModel] = {}
    for (model_id, gpu_type_id, _gpus), cost_model in sorted(active.items(), key=lambda i: i[0]):
        served = served_models.get(model_id)
        if served and gpu_type_id == served.reference_gpu_type_id and model_id not in references:
            references[model_id] = cost_model

    mixes: dict[int, MeanShape] = {}
    mu_per_request: dict[int, float] = {}
    for row in (
        UsageMinute.objects.filter(minute__gte=now - MIX_LOOKBACK)
        .values("served_model_id")
        .annotate(
            requests=Sum("requests"),
            inp=Sum("input_tokens"),
            cached=Sum("cached_input_tokens"),
            out=Sum("output_tokens"),
            mu=Sum("mu"),
        )
    ):
        if row["requests"]:
            n = row["requests"]
            mu_per_request[row["served_model_id"]] = (row["mu"] or 0.0) / n
            mixes[row["served_model_id"]] = MeanShape.of_totals(
                requests=n,
                input_tokens=row["inp"],
                cached_input_tokens=row["cached"],
                output_tokens=row["out"],
            )

    reserved: dict[tuple[int, int], list] = defaultdict(lambda: [0.0, False])
    for model_id, customer_id, mu, keep_warm in Reservation.objects.active_at(now).values_list(
        "served_model_id", "customer_id", "mu_per_minute", "keep_warm"
    ):
        entry = reserved[(model_id, customer_id)]
        entry[0] += mu
        entry[1] = entry[1] or keep_warm

    whole_minute = now.replace(second=0, microsecond=0)
    recent_minutes = RECENT_WINDOW.total_seconds() / 60
    demand: dict[tuple[int, int], tuple[float, float]] = {}
    for row in (
        UsageMinute.objects.filter(minute__gte=whole_minute - PEAK_WINDOW, minute__lt=whole_minute)
        .values("served_model_id", "customer_id")
        .annotate(
            recent=Sum("mu", filter=Q(minute__gte=whole_minute - RECENT_WINDOW)),
            peak=Max("mu"),
        )
    ):
        demand[(row["served_model_id"], row["customer_id"])] = (
            (row["recent"] or 0.0) / recent_minutes,
            row["peak"] or 0.0,
        )

    model_bursts = _bursts(now)

    last_used = dict(
        UsageMinute.objects.filter(minute__gte=now - IDLE_LOOKBACK, requests__gt=0)
        .values("served_model_id")
        .annotate(last=Max("minute"))
        .values_list("served_model_id", "last")
    )

    history: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for deployment_id, created_at, recommended in AllocationDecision.objects.filter(
        created_at__gte=now - timedelta(seconds=window_seconds), dry_run=False
    ).values_list("deployment_id", "created_at", "recommended_replicas"):
        history[deployment_id].append(((now - created_at).total_seconds(), recommended))

    loads = _loads(deployments)
    load_known = {deployment_id: load.known for deployment_id, load in loads.items()}

    by_model: dict[int, list[Deployment]] = defaultdict(list)
    for deployment in deployments:
        by_model[deployment.served_model_id].append(deployment)
    customers_of: dict[int, set[int]] = defaultdict(set)
    for model_id, customer_id in [*reserved, *demand]:
        customers_of[model_id].add(customer_id)
    models = []
    for model_id, model_deployments in by_model.items():
        mix = mixes.get(model_id, DEFAULT_MIX)
        states = []
        for d in model_deployments:
            own = active.get((model_id, d.gpu_pool.gpu_type_id, d.gpus_per_replica))
            broken = min(unhealthy.get(d.pk, 0), d.current_replicas)
            states.append(
                allocation.DeploymentState(
                    deployment_id=d.pk,
                    name=d.name,
                    pool_id=d.gpu_pool_id,
                    gpus_per_replica=d.gpus_per_replica,
                    mu_per_minute_per_replica=_replica_mu(references.get(model_id), own, mix),
                    current_replicas=d.current_replicas - broken,
                    ready_replicas=d.current_replicas - broken,
                    min_replicas=min(d.min_replicas, max(0, d.max_replicas - broken)),
                    max_replicas=max(0, d.max_replicas - broken),
                    cold_start_seconds=d.cold_start_seconds,
                    scale_to_zero_after_seconds=d.scale_to_zero_after_seconds,
                    target_utilisation=d.target_utilisation,
                    cost_per_hour_usd=float(d.gpu_pool.gpu_type.hourly_cost_usd)
                    * d.gpus_per_replica,
                    recent_recommendations=tuple(history.get(d.pk, ())),
                )
            )
        customer_ids = customers_of.get(model_id, set())
        customers = tuple(
            allocation.CustomerDemand(
                customer_id=customer_id,
                reserved_mu_per_minute=reserved.get((model_id, customer_id), [0.0, False])[0],
                recent_mu_per_minute=demand.get((model_id, customer_id), (0.0, 0.0))[0],
                peak_mu_per_minute=demand.get((model_id, customer_id), (0.0, 0.0))[1],
                keep_warm=reserved.get((model_id, customer_id), [0.0, False])[1],
            )
            for customer_id in sorted(customer_ids)
        )
        last = last_used.get(model_id)
        burst = model_bursts.get(model_id, NO_BURSTS)
        models.append(
            allocation.ModelSnapshot(
                model_id=model_id,
                name=model_deployments[0].served_model.name,
                customers=customers,
                deployments=tuple(states),
                idle_seconds=(now - last).total_seconds() if last else None,
                load_known=all(load_known.get(d.pk, True) for d in model_deployments),
                waiting_mu=_waiting_mu(model_deployments, loads, mu_per_request.get(model_id)),
                burst_mu_per_minute=burst.burst_mu_per_minute,
                burst_window_busiest_minute_mu=burst.busiest_minute_mu,
            )
        )
    snapshot = allocation.Snapshot(
        models=tuple(models),
        pools=tuple(pools),
        settings=allocation.PolicySettings(stabilisation_window_seconds=window_seconds),
    )
    return snapshot, {d.pk: d for d in deployments}, unhealthy


def with_replacements(
    decisions: allocation.Decisions, unhealthy: dict[int, int], deployments: dict
) -> allocation.Decisions:
    """Add the unhealthy replicas back to what the policy planned without them: they still
    exist (being restarted), so the actuator's target is the healthy plan plus them, and a
    replacement starts at once while they come back."""
    if not unhealthy:
        return decisions
    result = []
    for decision in decisions.deployments:
        broken = min(
            unhealthy.get(decision.deployment_id, 0),
            deployments[decision.deployment_id].current_replicas,
        )
        if broken:
            decision = replace(
                decision,
                current_replicas=decision.current_replicas + broken,
                recommended_replicas=decision.recommended_replicas + broken,
                target_replicas=decision.target_replicas + broken,
                reasons=(
                    *decision.reasons,
                    allocation.Reason(
                        "unhealthy_replicas",
                        f"{broken} unhealthy replica(s) are being restarted: planned without "
                        "them, so a replacement starts now",
                        {"unhealthy": broken},
                    ),
                ),
            )
        result.append(decision)
    return replace(decisions, deployments=tuple(result))


def _bursts(now: datetime) -> dict[int, Bursts]:
    """Per model, the bursts (`capacity.allocation.bursts`) of the requests that started in the last
    BURST_WINDOW (all customers together), from usage events in 1-second bins."""
    since = now - BURST_WINDOW
    seconds = int(BURST_WINDOW.total_seconds())
    bins: dict[int, np.ndarray] = {}
    for model_id, second, mu in (
        UsageEvent.objects.filter(started_at__gte=since, started_at__lt=now)
        .annotate(second=Trunc("started_at", "second"))
        .values("served_model_id", "second")
        .annotate(mu=Sum("mu"))
        .values_list("served_model_id", "second", "mu")
    ):
        series = bins.setdefault(model_id, np.zeros(seconds + 1))
        series[min(seconds, max(0, int((second - since).total_seconds())))] += mu
    slo_seconds = settings.ALLOCATION_TTFT_SLO_MS / 1000.0
    return {model_id: bursts(series, slo_seconds) for model_id, series in bins.items()}


def _waiting_mu(deployments: list[Deployment], loads: dict, mu_per_request: float | None) -> float:
    """MU of the requests queued in a model's engines, at the model's recent mean request.
    The queue is a gauge read directly, so it counts even when the load's rates are unknown."""
    waiting = sum(loads[d.pk].waiting or 0.0 for d in deployments if d.pk in loads)
    return waiting * (mu_per_request or 0.0)


def _loads(deployments: list[Deployment]) -> dict:
    """Each deployment's engine load (`capacity.telemetry.prometheus.DeploymentLoad`), when
    Prometheus is
    configured; without it metered usage is the only load signal and counts as known."""
    if not settings.PROMETHEUS_URL or not deployments:
        return {}
    from capacity.telemetry.prometheus import DeploymentLoad, read_fleet_load

    try:
        return read_fleet_load(deployments)
    except Exception:  # an unreadable fleet is an unknown load, never a reason to scale down
        logger.exception("reading the fleet's load from Prometheus failed")
        return {d.pk: DeploymentLoad.unknown(d.pk, "Prometheus unreadable", 0) for d in deployments}


def _digest(model: allocation.ModelSnapshot) -> str:
    # The dataclasses' repr is deterministic and far cheaper than asdict + JSON for models
    # with thousands of customers.
    return hashlib.sha256(repr(model).encode()).hexdigest()


# --- One tick at a time -----------------------------------------------------------------------


def _tick_lock():
    return exclusive(Lock.ALLOCATION_TICK)


# --- The tick ---------------------------------------------------------------------------------


def allocation_tick(*, dry_run: bool = False, now: datetime | None = None) -> TickResult:
    started = time.perf_counter()
    tick_id = uuid.uuid4()
    result = TickResult(tick_id=str(tick_id), dry_run=dry_run)
    with _tick_lock() as taken:
        if not taken:
            result.skipped = True
            return result
        now = now or timezone.now()
        snapshot, deployments, unhealthy = build_snapshot(now=now)
        decisions = with_replacements(allocation.decide(snapshot), unhealthy, deployments)
        result.models = [asdict(outcome) for outcome in decisions.models]
        result.allowances = (
            [asdict(a) for a in decisions.allowances] if dry_run else len(decisions.allowances)
        )
        digests = {model.model_id: _digest(model) for model in snapshot.models}
        if dry_run:
            result.decisions = [_decision_dict(d, deployments) for d in decisions.deployments]
            result.seconds = time.perf_counter() - started
            return result
        rows, forgotten = _store(tick_id, now, decisions, deployments, digests)
        # Admission limits follow the tick within the tick (a reservation that starts or ends
        # changes admission within one tick).
        publish_limits(decisions.allowances, forgotten)
        _apply(rows, decisions, deployments, result, now)
        result.decisions = [_row_dict(row) for row in rows]
        record_capacity(now=now)
    result.seconds = time.perf_counter() - started
    metrics.TICK_SECONDS.observe(result.seconds)
    return result


@transaction.atomic
def _store(tick_id, now, decisions, deployments, digests) -> list[AllocationDecision]:
    rows = [
        AllocationDecision(
            tick_id=tick_id,
            deployment_id=d.deployment_id,
            served_model_id=d.model_id,
            inputs_digest=digests[d.model_id],
            current_replicas=d.current_replicas,
            recommended_replicas=d.recommended_replicas,
            target_replicas=d.target_replicas,
            reasons=[reason.as_dict() for reason in d.reasons]
            + _config_problem_reasons(deployments[d.deployment_id]),
            actuator_kind=deployments[d.deployment_id].actuator_kind,
            created_at=now,
        )
        for d in decisions.deployments
    ]
    if connection.vendor == "postgresql":
        columns = (
            "tick_id",
            "deployment_id",
            "served_model_id",
            "created_at",
            "inputs_digest",
            "current_replicas",
            "recommended_replicas",
            "target_replicas",
            "reasons",
            "dry_run",
            "actuator_kind",
            "actuator_attempts",
            "actuator_error",
        )
        ids = dict(
            (deployment_id, pk)
            for pk, deployment_id in copy_upsert(
                table=AllocationDecision._meta.db_table,
                columns=columns,
                rows=[
                    (
                        r.tick_id,
                        r.deployment_id,
                        r.served_model_id,
                        now,
                        r.inputs_digest,
                        r.current_replicas,
                        r.recommended_replicas,
                        r.target_replicas,
                        r.reasons,
                        False,
                        r.actuator_kind,
                        0,
                        "",
                    )
                    for r in rows
                ],
                returning=("id", "deployment_id"),
            )
        )
        for row in rows:
            row.pk = ids[row.deployment_id]
    else:
        rows = AllocationDecision.objects.bulk_create(rows)
    forgotten = _store_allowances(tick_id, now, decisions.allowances)
    return rows, forgotten


# An allowance that moved by less than this share is not rewritten: best-effort shares drift
# a little every tick, and a 1 % change does not matter to a token bucket refilled every 15 s.
ALLOWANCE_RELATIVE_TOLERANCE = 0.01
ALLOWANCE_TOLERANCE_MU = 1e-6


def _close(old: float, new: float) -> bool:
    return abs(old - new) <= max(ALLOWANCE_TOLERANCE_MU, ALLOWANCE_RELATIVE_TOLERANCE * abs(new))


def _store_allowances(tick_id, now, allowances) -> set[tuple[int, int]]:
    """Write only the allowances that changed, and delete those the policy no longer gives
    (returned as (customer, model) pairs): most are stable from one tick to the next, and
    rewriting tens of thousands of rows every 15 s would cost more than the rest of the tick."""
    rows = AdmissionAllowance.objects.values_list(
        "pk",
        "customer_id",
        "served_model_id",
        "guaranteed_mu_per_minute",
        "best_effort_mu_per_minute",
    )
    existing = {(c, m): (pk, g, b) for pk, c, m, g, b in rows}
    changed = []
    for allowance in allowances:
        key = (allowance.customer_id, allowance.model_id)
        old = existing.pop(key, None)
        # Reservations are exact: any change to the guaranteed rate is written.
        if (
            old is not None
            and abs(old[1] - allowance.guaranteed_mu_per_minute) <= ALLOWANCE_TOLERANCE_MU
            and _close(old[2], allowance.best_effort_mu_per_minute)
        ):
            continue
        changed.append(
            (
                allowance.customer_id,
                allowance.model_id,
                allowance.guaranteed_mu_per_minute,
                allowance.best_effort_mu_per_minute,
                tick_id,
                now,
            )
        )
    if changed and connection.vendor == "postgresql":
        copy_upsert(
            table=AdmissionAllowance._meta.db_table,
            columns=(
                "customer_id",
                "served_model_id",
                "guaranteed_mu_per_minute",
                "best_effort_mu_per_minute",
                "tick_id",
                "updated_at",
            ),
            rows=changed,
            conflict=("customer_id", "served_model_id"),
            update=(
                "guaranteed_mu_per_minute",
                "best_effort_mu_per_minute",
                "tick_id",
                "updated_at",
            ),
        )
    elif changed:
        AdmissionAllowance.objects.bulk_create(
            [
                AdmissionAllowance(
                    customer_id=c,
                    served_model_id=m,
                    guaranteed_mu_per_minute=g,
                    best_effort_mu_per_minute=b,
                    tick_id=t,
                    updated_at=u,
                )
                for c, m, g, b, t, u in changed
            ],
            batch_size=5000,
            update_conflicts=True,
            unique_fields=["customer", "served_model"],
            update_fields=[
                "guaranteed_mu_per_minute",
                "best_effort_mu_per_minute",
                "tick_id",
                "updated_at",
            ],
        )
    # Customers the policy no longer sees (reservation ended, no recent use) lose their rows.
    stale = [pk for pk, _, _ in existing.values()]
    if stale:
        AdmissionAllowance.objects.filter(pk__in=stale).delete()
    return set(existing)


def _apply(rows, decisions, deployments, result: TickResult, now) -> None:
    from capacity.actuation.registry import actuator_for

    circuits = {c.deployment_id: c for c in ActuatorCircuit.objects.all()}
    work = []
    for row, decision in zip(rows, decisions.deployments, strict=True):
        if decision.target_replicas == decision.current_replicas:
            continue
        circuit = circuits.get(decision.deployment_id)
        if circuit and circuit.opened_until and circuit.opened_until > now:
            row.actuator_ok = False
            row.actuator_error = (
                f"circuit open until {circuit.opened_until.isoformat()} after "
                f"{circuit.consecutive_failures} failures: {circuit.last_error[:200]}"
            )
            row.save(update_fields=["actuator_ok", "actuator_error"])
            result.failed += 1
            continue
        deployment = deployments[decision.deployment_id]
        if deployment.actuator_config_problem:
            # Never sent: the stored config breaks the operator's rules (it may name a secret
            # or a host the API may not choose) until a valid one is written.
            row.actuator_ok = False
            row.actuator_attempts = 0
            row.actuator_error = (
                f"refused: the stored actuator config breaks the operator's rules: "
                f"{deployment.actuator_config_problem}"
            )
            row.save(update_fields=["actuator_ok", "actuator_attempts", "actuator_error"])
            metrics.ACTUATOR_FAILURES.labels(deployment.actuator_kind).inc()
            result.failed += 1
            continue
        request = ScaleRequest(
            deployment_id=deployment.pk,
            deployment=deployment.name,
            model=deployment.served_model.engine_model_id,
            target_replicas=decision.target_replicas,
            current_replicas=decision.current_replicas,
            config=deployment.actuator_config,
            endpoint_url=deployment.endpoint_url,
            decision_id=row.pk,
            reasons=row.reasons,
        )
        work.append((row, request, deployment.actuator_kind))

    deadline = settings.ALLOCATION_PUSH_DEADLINE_SECONDS

    def push(item, abandoned: threading.Event) -> ActuatorResult:
        _, request, kind = item

        def sleep_unless_abandoned(seconds: float) -> None:
            # A push abandoned at its deadline starts no further attempt.
            if abandoned.wait(seconds):
                raise _Abandoned

        try:
            return apply_with_retries(
                _BoundedActuator(actuator_for(kind), time.monotonic() + deadline, abandoned),
                request,
                deadline_seconds=deadline,
                sleep=sleep_unless_abandoned,
            )
        except _Abandoned:
            return ActuatorResult(ok=False, error="abandoned at the push deadline")
        except Exception as error:  # one broken actuator must not stop the others
            return ActuatorResult(ok=False, error=f"{type(error).__name__}: {error}")

    results = _push_all(work, push, deadline)
    outcomes = [(row, outcome) for (row, _, _), outcome in zip(work, results, strict=True)]
    applied_at = timezone.now()
    succeeded = []
    for row, outcome in outcomes:
        row.actuator_ok = outcome.ok
        row.actuator_attempts = outcome.attempts
        row.actuator_error = outcome.error
        row.observed_replicas = outcome.observed_replicas
        row.applied_at = applied_at
        if outcome.ok:
            result.applied += 1
            succeeded.append(row)
        else:
            metrics.ACTUATOR_FAILURES.labels(deployments[row.deployment_id].actuator_kind).inc()
            result.failed += 1
            _record_failure(row.deployment_id, outcome.error, now)
    AllocationDecision.objects.bulk_update(
        [row for row, _ in outcomes],
        ["actuator_ok", "actuator_attempts", "actuator_error", "observed_replicas", "applied_at"],
        batch_size=1000,
    )
    _record_applied(succeeded)


class _Abandoned(Exception):
    """The tick gave up on this push at its deadline."""


# Kinds whose config carries a per-request `timeout_seconds` (capacity/actuation/config.py),
# with the actuator's default.
_TIMEOUT_KINDS = {"webhook": 5.0, "kubernetes": 5.0}


class _BoundedActuator(Actuator):
    """An actuator whose every attempt ends by the push's deadline: the attempt's HTTP timeout
    is what remains of it, so the client gives up (and closes the connection) before the tick
    moves on, never after; no attempt starts once the push is abandoned."""

    def __init__(self, inner: Actuator, deadline_at: float, abandoned: threading.Event):
        self.inner, self.deadline_at, self.abandoned = inner, deadline_at, abandoned
        self.kind = inner.kind

    def apply(self, request: ScaleRequest) -> int | None:
        remaining = self.deadline_at - time.monotonic()
        if self.abandoned.is_set() or remaining < 0.1:
            raise _Abandoned
        if self.kind in _TIMEOUT_KINDS:
            configured = float(request.config.get("timeout_seconds") or _TIMEOUT_KINDS[self.kind])
            timeout = max(0.1, min(configured, remaining))
            request = replace(request, config={**request.config, "timeout_seconds": timeout})
        return self.inner.apply(request)


def _push_all(work: list, push, deadline: float) -> list[ActuatorResult]:
    """push(item, abandoned) for every item, at most ACTUATOR_THREADS at a time, each in its
    own daemon thread. A push still running `deadline` seconds after it started is recorded as
    failed and abandoned: the tick does not wait for it, its thread may start no new attempt
    (`abandoned` is set) and whatever it answers later is dropped, never recorded or applied.
    An abandoned push frees its slot, so one hanging actuator never stalls the others."""
    results: dict[int, ActuatorResult] = {}
    finished: queue.SimpleQueue = queue.SimpleQueue()
    waiting = list(enumerate(work))
    running: dict[int, tuple[float, threading.Event]] = {}

    def run(index, item, abandoned):
        finished.put((index, push(item, abandoned)))

    while waiting or running:
        while waiting and len(running) < ACTUATOR_THREADS:
            index, item = waiting.pop(0)
            abandoned = threading.Event()
            running[index] = (time.monotonic(), abandoned)
            threading.Thread(
                target=run, args=(index, item, abandoned), name="actuator-push", daemon=True
            ).start()
        first_deadline = min(started for started, _ in running.values()) + deadline
        try:
            index, outcome = finished.get(timeout=max(0.0, first_deadline - time.monotonic()))
            if running.pop(index, None) is not None:  # else: abandoned, the answer is dropped
                results[index] = outcome
        except queue.Empty:
            pass
        now = time.monotonic()
        for index, (started, abandoned) in list(running.items()):
            if now - started >= deadline:
                abandoned.set()
                del running[index]
                results[index] = ActuatorResult(
                    ok=False,
                    error=f"no answer within the push deadline of {deadline:g} s "
                    "(ALLOCATION_PUSH_DEADLINE_SECONDS); abandoned, the next tick decides afresh",
                )
    return [results[index] for index in range(len(work))]


def _record_applied(rows: list[AllocationDecision]) -> None:
    if not rows:
        return
    ids = [row.deployment_id for row in rows]
    if connection.vendor == "postgresql":
        # One statement for the whole fleet; conditional on the count the tick saw, so a
        # planner's edit in between wins over this tick's view.
        values = ", ".join(["(%s, %s, %s)"] * len(rows))
        params = [
            v
            for row in rows
            for v in (row.deployment_id, row.current_replicas, row.target_replicas)
        ]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE capacity_deployment AS d SET current_replicas = v.target "  # noqa: S608
                f"FROM (VALUES {values}) AS v(id, seen, target) "
                "WHERE d.id = v.id AND d.current_replicas = v.seen",
                params,
            )
    else:
        for row in rows:
            Deployment.objects.filter(
                pk=row.deployment_id, current_replicas=row.current_replicas
            ).update(current_replicas=row.target_replicas)
    ActuatorCircuit.objects.filter(deployment_id__in=ids, consecutive_failures__gt=0).update(
        consecutive_failures=0, opened_until=None, last_error=""
    )


def _record_failure(deployment_id: int, error: str, now) -> None:
    circuit, _ = ActuatorCircuit.objects.get_or_create(deployment_id=deployment_id)
    circuit.consecutive_failures += 1
    circuit.last_error = error[:2000]
    if circuit.consecutive_failures >= CIRCUIT_THRESHOLD:
        seconds = min(
            CIRCUIT_MAX_SECONDS,
            CIRCUIT_BASE_SECONDS * 2 ** (circuit.consecutive_failures - CIRCUIT_THRESHOLD),
        )
        circuit.opened_until = now + timedelta(seconds=seconds)
    circuit.save()


def _decision_dict(decision: allocation.DeploymentDecision, deployments) -> dict:
    return {
        "deployment": deployments[decision.deployment_id].name,
        "current_replicas": decision.current_replicas,
        "recommended_replicas": decision.recommended_replicas,
        "target_replicas": decision.target_replicas,
        "reasons": [reason.as_dict() for reason in decision.reasons]
        + _config_problem_reasons(deployments[decision.deployment_id]),
    }


def _config_problem_reasons(deployment: Deployment) -> list[dict]:
    if not deployment.actuator_config_problem:
        return []
    return [
        allocation.Reason(
            code="actuator_config_refused",
            message=(
                "Not applied: the stored actuator config breaks the operator's rules "
                f"({deployment.actuator_config_problem}); write a valid config to resume."
            ),
            data={"problem": deployment.actuator_config_problem},
        ).as_dict()
    ]


def _row_dict(row: AllocationDecision) -> dict:
    return {
        "id": row.pk,
        "deployment_id": row.deployment_id,
        "current_replicas": row.current_replicas,
        "recommended_replicas": row.recommended_replicas,
        "target_replicas": row.target_replicas,
        "reasons": row.reasons,
        "actuator_ok": row.actuator_ok,
        "actuator_error": row.actuator_error,
    }
