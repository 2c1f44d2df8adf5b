"""The allocation tick: snapshot from the database → the policy → decisions stored → targets
applied through actuators (docs/design.md#the-tick). Run every 15 s by Celery beat.

One tick runs at a time across all workers: a PostgreSQL advisory lock (a Redis lock on the
SQLite demo database); a tick that finds it taken skips. Actuators are called outside any
database transaction and only with this tick's targets, so a failed push is never re-applied
later: the next tick decides afresh. Repeated failures open a circuit for the deployment.
Pushes run concurrently, each within ALLOCATION_PUSH_DEADLINE_SECONDS: one that misses it is a
failure on its decision, and the tick (which holds the lock) does not wait for it.

Level-triggered where the data plane can say what it runs (Kubernetes,
capacity/actuation/observe.py): the tick reads each workload first, and pushes whenever what
runs differs from the target, not only when the target changes, recording the drift it
corrected. A scale-down chooses the pods that go and drains them from the gateways first
(capacity/actuation/drain.py).
"""

import gc
import logging
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from capacity.actuation import drain
from capacity.actuation import registry as actuators
from capacity.actuation.base import ActuatorResult, Observation, ScaleRequest, apply_with_retries
from capacity.actuation.kubernetes import hpa_bounds, mode_of
from capacity.actuation.observe import observe_fleet
from capacity.actuation.observe import owns_count as _owns_count
from capacity.actuation.push import Abandoned, BoundedActuator, push_all
from capacity.admission.gate import publish_limits
from capacity.allocation import policy as allocation
from capacity.allocation.circuits import record_applied, record_failure
from capacity.allocation.heartbeat import heartbeat_record
from capacity.allocation.prediction import prediction_store
from capacity.allocation.snapshot import build_snapshot, digest, with_holds, with_replacements
from capacity.models import (
    ActuatorCircuit,
    ActuatorKind,
    AdmissionAllowance,
    AllocationDecision,
    Deployment,
    Replica,
)
from capacity.publication.publish import publish_gateway_state
from capacity.selling.at_risk import fleet_recheck
from capacity.telemetry import metrics
from core.db import Lock, copy_update, copy_upsert, exclusive

logger = logging.getLogger(__name__)


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


# --- One tick at a time -----------------------------------------------------------------------


def _tick_lock():
    return exclusive(Lock.ALLOCATION_TICK)


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off for the tick: the tick allocates hundreds of thousands
    of objects at fleet scale (snapshot, decisions, allowances), which set off full collections
    of the whole process's heap, about a fifth of the tick at 1,000 deployments. What the tick
    leaves in cycles is collected once it is back on; one left off already stays off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --- The tick ---------------------------------------------------------------------------------


def allocation_tick(*, dry_run: bool = False, now: datetime | None = None) -> TickResult:
    with _collector_paused():
        return _allocation_tick(dry_run=dry_run, now=now)


def _allocation_tick(*, dry_run: bool, now: datetime | None) -> TickResult:
    started = time.perf_counter()
    tick_id = uuid.uuid4()
    result = TickResult(tick_id=str(tick_id), dry_run=dry_run)
    with _tick_lock() as taken:
        if not taken:
            result.skipped = True
            return result
        now = now or timezone.now()
        # What runs, read from the data plane before deciding (a dry run only reads the
        # database).
        # Only Kubernetes workloads can be observed (observe.observable): the rest of the
        # fleet is not read here.
        observations = (
            {}
            if dry_run
            else observe_fleet(
                list(Deployment.objects.filter(actuator_kind=ActuatorKind.KUBERNETES)), now
            )
        )
        snapshot, deployments, unhealthy = build_snapshot(now=now)
        decisions = with_holds(
            with_replacements(allocation.decide(snapshot), unhealthy, deployments), deployments
        )
        result.models = [asdict(outcome) for outcome in decisions.models]
        result.allowances = (
            [asdict(a) for a in decisions.allowances] if dry_run else len(decisions.allowances)
        )
        digests = {model.model_id: digest(model) for model in snapshot.models}
        if dry_run:
            result.decisions = [_decision_dict(d, deployments) for d in decisions.deployments]
            result.seconds = time.perf_counter() - started
            return result
        rows, changed, forgotten = _store(tick_id, now, decisions, deployments, digests)
        # The SLO correction the next tick starts from, and the planner's view of rule 3c.
        prediction_store(now, snapshot, decisions)
        # Admission limits follow the tick within the tick (a reservation that starts or ends
        # changes admission within one tick): the allowances it rewrote, all of them once a
        # minute.
        publish_limits(decisions.allowances, forgotten, changed=changed)
        _apply(rows, decisions, deployments, result, now, observations)
        result.decisions = [_row_dict(row) for row in rows]
        # Stored per model (CapacityRisk): the minute's capacity sample, a task of its own
        # (capacity.metering.history), reads it from there.
        _recheck(now, decisions)
        # Every tick republishes the gateways' documents whole, so a gateway that starts cold
        # (or missed a change) is serving on the current state within one tick.
        publish_gateway_state(reason="allocation tick")
        result.seconds = time.perf_counter() - started
        # The loop's pulse (/readyz, /metrics, the planner, the health worker's watch).
        heartbeat_record(tick_id=tick_id, seconds=result.seconds)
    metrics.TICK_SECONDS.observe(result.seconds)
    return result


def _recheck(now, decisions) -> dict[int, tuple[float, float]]:
    """Is what is sold still feasible, and could the tick make it hot? Stored per model and
    alerted on change (capacity.selling.at_risk); a failure here never stops the tick."""
    guaranteed = {m.model_id: m.guaranteed_shortfall_mu_per_minute for m in decisions.models}
    try:
        return fleet_recheck(now=now, guaranteed_shortfall=guaranteed)
    except Exception:
        logger.exception("the fleet's sellability re-check failed")
        return {}


@transaction.atomic
def _store(
    tick_id, now, decisions, deployments, digests
) -> tuple[list[AllocationDecision], set[tuple[int, int]], set[tuple[int, int]]]:
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
            ready_replicas=d.ready_replicas,
            starting_replicas=d.starting_replicas,
            draining_replicas=d.draining_replicas,
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
            "ready_replicas",
            "starting_replicas",
            "draining_replicas",
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
                        r.ready_replicas,
                        r.starting_replicas,
                        r.draining_replicas,
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
    changed, forgotten = _store_allowances(tick_id, now, decisions.allowances)
    return rows, changed, forgotten


# An allowance that moved by less than this share is not rewritten: best-effort shares drift
# a little every tick, and a 1 % change does not matter to a token bucket refilled every 15 s.
ALLOWANCE_RELATIVE_TOLERANCE = 0.01
ALLOWANCE_TOLERANCE_MU = 1e-6


def _close(old: float, new: float) -> bool:
    return abs(old - new) <= max(ALLOWANCE_TOLERANCE_MU, ALLOWANCE_RELATIVE_TOLERANCE * abs(new))


# The columns of an allowance the tick writes, in the order of `_changed_allowances`' rows.
_ALLOWANCE_COLUMNS = (
    "customer_id",
    "served_model_id",
    "guaranteed_mu_per_minute",
    "best_effort_mu_per_minute",
    "tick_id",
    "updated_at",
)
_ALLOWANCE_UPDATED = _ALLOWANCE_COLUMNS[2:]


def _store_allowances(
    tick_id, now, allowances
) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """Write only the allowances that changed, and delete those the policy no longer gives;
    returns both as (customer, model) pairs: most are stable from one tick to the next, and
    rewriting tens of thousands of rows every 15 s would cost more than the rest of the tick."""
    rows = AdmissionAllowance.objects.values_list(
        "pk",
        "customer_id",
        "served_model_id",
        "guaranteed_mu_per_minute",
        "best_effort_mu_per_minute",
    )
    existing = {(c, m): (pk, g, b) for pk, c, m, g, b in rows}
    changed = _changed_allowances(existing, allowances, tick_id, now)
    if changed:
        _upsert_allowances(changed)
    # Customers the policy no longer sees (reservation ended, no recent use) lose their rows.
    stale = [pk for pk, _, _ in existing.values()]
    if stale:
        AdmissionAllowance.objects.filter(pk__in=stale).delete()
    return {(c, m) for c, m, *_ in changed}, set(existing)


def _changed_allowances(existing: dict, allowances, tick_id, now) -> list[tuple]:
    """The allowances that differ from the stored ones, as rows of _ALLOWANCE_COLUMNS; those
    found are taken out of `existing`, which is left holding the ones no longer given."""
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
    return changed


def _upsert_allowances(changed: list[tuple]) -> None:
    """Insert or update the rows: one COPY on PostgreSQL, a bulk upsert elsewhere."""
    if connection.vendor == "postgresql":
        copy_upsert(
            table=AdmissionAllowance._meta.db_table,
            columns=_ALLOWANCE_COLUMNS,
            rows=changed,
            conflict=("customer_id", "served_model_id"),
            update=_ALLOWANCE_UPDATED,
        )
        return
    AdmissionAllowance.objects.bulk_create(
        [AdmissionAllowance(**dict(zip(_ALLOWANCE_COLUMNS, row, strict=True))) for row in changed],
        batch_size=5000,
        update_conflicts=True,
        unique_fields=["customer", "served_model"],
        update_fields=list(_ALLOWANCE_UPDATED),
    )


@dataclass(frozen=True)
class _Push:
    """One target on its way to the data plane: the decision's row, what is sent, and how."""

    row: AllocationDecision
    request: ScaleRequest
    kind: str


def _apply(
    rows, decisions, deployments, result: TickResult, now, observations: dict[int, Observation]
) -> None:
    """Push the targets that need it through their actuators, in parallel within the push
    deadline, after draining the pods a scale-down removes; record each outcome on its row."""
    work, leaving = _pushes(rows, decisions, deployments, result, now, observations)
    if leaving:
        # Before the scale-down: the gateways stop routing to the pods that will go.
        drain.mark_draining([r for going in leaving.values() for r in going])
        publish_gateway_state(reason="scale-down: draining the pods that go")
    results = _push_all(work)
    _record_outcomes(work, results, deployments, leaving, result, now)


def _pushes(
    rows, decisions, deployments, result: TickResult, now, observations: dict[int, Observation]
) -> tuple[list[_Push], dict[int, list[Replica]]]:
    """What this tick sends (and the pods each scale-down removes, by row); a push refused by
    an open circuit or a config the operator's rules refuse is recorded as failed at once."""
    circuits = {c.deployment_id: c for c in ActuatorCircuit.objects.all()}
    work: list[_Push] = []
    leaving: dict[int, list[Replica]] = {}
    observed_rows = []
    for row, decision in zip(rows, decisions.deployments, strict=True):
        deployment = deployments[decision.deployment_id]
        observation = observations.get(decision.deployment_id)
        if deployment.actuator_kind == ActuatorKind.KUBERNETES:
            # Stored below with the reasons _needs_push may add (drift, bounds).
            row.observed_spec_replicas = observation.spec_replicas if observation else None
            observed_rows.append(row)
        if not _needs_push(row, decision, deployment, observation):
            continue
        if _refused(row, deployment, circuits.get(decision.deployment_id), now):
            result.failed += 1
            continue
        going = _leaving(row, deployment, decision, observation)
        if going:
            leaving[row.pk] = going
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
            floor_replicas=decision.floor_replicas,
            ceiling_replicas=decision.ceiling_replicas,
            leaving_pods=tuple(drain.pod_name(r) for r in going),
        )
        work.append(_Push(row, request, deployment.actuator_kind))
    if observed_rows:
        copy_update(
            model=AllocationDecision,
            rows=observed_rows,
            fields=["observed_spec_replicas", "reasons"],
        )
    return work, leaving


def _refused(row, deployment: Deployment, circuit: ActuatorCircuit | None, now) -> bool:
    """Whether the push is not sent: its circuit is open, or its stored config breaks the
    operator's rules (it may name a secret or a host the API may not choose) until a valid
    one is written. The row says why."""
    if circuit and circuit.opened_until and circuit.opened_until > now:
        row.actuator_ok = False
        row.actuator_error = (
            f"circuit open until {circuit.opened_until.isoformat()} after "
            f"{circuit.consecutive_failures} failures: {circuit.last_error[:200]}"
        )
        row.save(update_fields=["actuator_ok", "actuator_error"])
        return True
    if deployment.actuator_config_problem:
        row.actuator_ok = False
        row.actuator_attempts = 0
        row.actuator_error = (
            f"refused: the stored actuator config breaks the operator's rules: "
            f"{deployment.actuator_config_problem}"
        )
        row.save(update_fields=["actuator_ok", "actuator_attempts", "actuator_error"])
        metrics.ACTUATOR_FAILURES.labels(deployment.actuator_kind).inc()
        return True
    return False


def _push_all(work: list[_Push]) -> list[ActuatorResult]:
    """Each push's result, in order: with retries, each within the push deadline."""
    deadline = settings.ALLOCATION_PUSH_DEADLINE_SECONDS

    def push(item: _Push, abandoned: threading.Event) -> ActuatorResult:
        def sleep_unless_abandoned(seconds: float) -> None:
            # A push abandoned at its deadline starts no further attempt.
            if abandoned.wait(seconds):
                raise Abandoned

        try:
            return apply_with_retries(
                BoundedActuator(
                    actuators.actuator_for(item.kind), time.monotonic() + deadline, abandoned
                ),
                item.request,
                deadline_seconds=deadline,
                sleep=sleep_unless_abandoned,
            )
        except Abandoned:
            return ActuatorResult(ok=False, error="abandoned at the push deadline")
        except Exception as error:  # one broken actuator must not stop the others
            return ActuatorResult(ok=False, error=f"{type(error).__name__}: {error}")

    # A dry run touches nothing and cannot hang: pushed in line, not one thread each (a
    # thread per push cost seconds a tick at thousands of deployments).
    threaded = iter(
        push_all([item for item in work if item.kind != ActuatorKind.DRY_RUN], push, deadline)
    )
    return [
        push(item, threading.Event()) if item.kind == ActuatorKind.DRY_RUN else next(threaded)
        for item in work
    ]


def _record_outcomes(
    work: list[_Push], results: list[ActuatorResult], deployments, leaving, result, now
) -> None:
    """Each push's outcome on its row and its circuit; a failed scale-down's pods serve
    again."""
    outcomes = [(item.row, outcome) for item, outcome in zip(work, results, strict=True)]
    applied_at = timezone.now()
    succeeded, bounded = [], []
    for row, outcome in outcomes:
        row.actuator_ok = outcome.ok
        row.actuator_attempts = outcome.attempts
        row.actuator_error = outcome.error
        row.observed_replicas = outcome.observed_replicas
        row.applied_at = applied_at
        if outcome.ok:
            result.applied += 1
            owned = _owns_count(deployments[row.deployment_id])
            (succeeded if owned else bounded).append(row)
        else:
            metrics.ACTUATOR_FAILURES.labels(deployments[row.deployment_id].actuator_kind).inc()
            result.failed += 1
            record_failure(row.deployment_id, outcome.error, now)
            if row.pk in leaving:
                drain.serve_again(leaving[row.pk])
    copy_update(
        model=AllocationDecision,
        rows=[row for row, _ in outcomes],
        fields=[
            "actuator_ok",
            "actuator_attempts",
            "actuator_error",
            "observed_replicas",
            "applied_at",
        ],
    )
    record_applied(succeeded)
    # Bounds set: the circuit closes, but the count stays the autoscaler's.
    record_applied(bounded, counts=False)
    if any(row.pk in leaving and not outcome.ok for row, outcome in outcomes):
        publish_gateway_state(reason="scale-down failed: its pods serve again")


def _needs_push(row, decision, deployment: Deployment, observation: Observation | None) -> bool:
    """Whether this tick writes to the data plane, and why (a reason on the decision)."""
    if deployment.actuator_kind != ActuatorKind.KUBERNETES:
        return decision.target_replicas != decision.current_replicas
    config = deployment.actuator_config if isinstance(deployment.actuator_config, dict) else {}
    mode = mode_of(config)
    if mode == "metric":
        # Nothing is written: /metrics publishes the target (mu_desired_replicas). The
        # autoscaler's scale-down drains nothing, which the decision says (_leaving).
        _leaving(row, deployment, decision, observation)
        return False
    if mode == "hpa-bounds":
        wanted = hpa_bounds(
            decision.floor_replicas, decision.ceiling_replicas, deployment.max_replicas
        )
        found = observation.bounds if observation is not None else None
        if found == wanted:
            return False
        row.reasons.append(
            allocation.Reason(
                "hpa_bounds",
                f"autoscaler bounds {found[0]}..{found[1]} → {wanted[0]}..{wanted[1]}"
                if found
                else f"autoscaler bounds → {wanted[0]}..{wanted[1]}",
                {"observed": list(found) if found else None, "bounds": list(wanted)},
            ).as_dict()
        )
        return True
    spec = observation.spec_replicas if observation is not None else None
    if decision.target_replicas == decision.current_replicas:
        if spec is None or spec == decision.target_replicas:
            return False
        row.reasons.append(
            allocation.Reason(
                "drift_corrected",
                f"the workload ran {spec} replica(s), not the {decision.target_replicas} "
                "set: set again",
                {"observed_spec_replicas": spec, "target_replicas": decision.target_replicas},
            ).as_dict()
        )
    return True


def _leaving(
    row, deployment: Deployment, decision, observation: Observation | None
) -> list[Replica]:
    """A Kubernetes scale-down's pods that go first, drained from the gateways before it where
    the platform honours the choice (capacity/actuation/drain.py); a reason on the decision
    names them, or says why none is drained."""
    if deployment.actuator_kind != ActuatorKind.KUBERNETES:
        return []
    config = deployment.actuator_config if isinstance(deployment.actuator_config, dict) else {}
    mode = mode_of(config)
    to_replicas = decision.target_replicas
    if mode == "hpa-bounds":
        # The autoscaler's count ends at most at the maximum pushed (as _needs_push compares).
        to_replicas = hpa_bounds(
            decision.floor_replicas, decision.ceiling_replicas, deployment.max_replicas
        )[1]
    plan = drain.plan(
        config, observation, current_replicas=decision.current_replicas, to_replicas=to_replicas
    )
    if plan.leaving_replicas <= 0:
        return []
    going = drain.leaving_pods(plan, config, list(deployment.replicas.all()))
    data = {
        "mode": mode,
        "kind": config.get("kind", "Deployment"),
        "removed_by": plan.removed_by or None,
        "leaving_replicas": plan.leaving_replicas,
    }
    if going:
        names = [drain.pod_name(r) for r in going]
        honoured = (
            "their deletion cost is lowered so the ReplicaSet removes them"
            if plan.how == drain.DELETION_COST
            else f"the {plan.removed_by} removes its highest ordinals"
        )
        reason = allocation.Reason(
            drain.DRAINED,
            f"{', '.join(names)} leave the gateways before the scale-down; {honoured}",
            data | {"pods": names, "how": plan.how},
        )
    else:
        reason = allocation.Reason(
            drain.SKIPPED,
            plan.why_not
            or "No serving pod to choose (none probed ready yet, or held by a benchmark run).",
            data,
        )
    row.reasons.append(reason.as_dict())
    return going


def _decision_dict(decision: allocation.DeploymentDecision, deployments) -> dict:
    return {
        "deployment": deployments[decision.deployment_id].name,
        "current_replicas": decision.current_replicas,
        "ready_replicas": decision.ready_replicas,
        "starting_replicas": decision.starting_replicas,
        "draining_replicas": decision.draining_replicas,
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
        "ready_replicas": row.ready_replicas,
        "starting_replicas": row.starting_replicas,
        "draining_replicas": row.draining_replicas,
        "recommended_replicas": row.recommended_replicas,
        "target_replicas": row.target_replicas,
        "reasons": row.reasons,
        "actuator_ok": row.actuator_ok,
        "actuator_error": row.actuator_error,
    }
