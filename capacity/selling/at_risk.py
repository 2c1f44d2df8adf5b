"""At-risk capacity: reservations sold that the fleet can no longer serve (docs/design.md#sold).

What is sold stays feasible only while the fleet stays as it was when it was sold. Every
catalogue or pricing change that can shrink what the fleet serves (a pool's gpu_count, a
deployment's max_replicas, GPUs per replica, pool or model, its deletion, a model's headroom,
overcommit or reference GPU type, activating or retiring a cost model) runs inside
`capacity_change`: it locks every model the change touches and every model sharing a pool with
them (`lock_models_sharing_pools`), measures the least unserved sold MU/min at every moment
from now before and after the write (capacity.selling.feasibility), and refuses a change that
leaves more unserved at any moment with 409, naming the reservations at risk. A planner may
force it with a reason, recorded in the audit log.

Whatever its cause, the state is kept per model in `CapacityRisk`, re-checked by every such
change and by every allocation tick (`fleet_recheck`, which also stores the tick's guaranteed
shortfall: sold capacity it cannot make hot). A model with sold MU/min unserved is "oversold",
and so are the customers whose reservations are in term while it is short. Entering and
leaving each state sends one signed webhook alert (ALERT_WEBHOOK_URL, signed as the webhook
actuator signs: capacity.actuation.webhook), after the commit that recorded the change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from django.db import transaction
from django.utils import timezone

from capacity.models import CapacityRisk, Deployment, Reservation, ServedModel
from capacity.selling.feasibility import components, pareto_moments, tolerance
from capacity.selling.selectors import MAX_NAMED_RESERVATIONS
from capacity.selling.sellable import (
    JointFleet,
    SoldMoments,
    deployment_edges,
    joint_fleet,
    lock_models_sharing_pools,
    sold_moments,
)
from capacity.telemetry.alerts import send_alert
from core.audit import audit_record, current_actor
from core.db import copy_update
from core.errors import ConflictError, DomainError

logger = logging.getLogger(__name__)

OVERSOLD = "oversold"
GUARANTEED_SHORTFALL = "guaranteed_shortfall"


@dataclass(frozen=True)
class ModelRisk:
    model_id: int
    model: str
    oversold_mu_per_minute: float
    at: datetime
    reservation_ids: list[int]
    binding_pools: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GroupCheck:
    """The least unserved sold MU/min of a group of models, at the moments that matter."""

    fleet: JointFleet
    sold: SoldMoments
    kept: np.ndarray  # indices into sold.moments: the moments no other dominates
    per_model: np.ndarray  # kept moments × models
    binding_pools: list[list[str]]  # per kept moment

    @property
    def per_moment(self) -> np.ndarray:
        totals: np.ndarray = self.per_model.sum(axis=1)
        return totals

    def risks(self, *, only: np.ndarray | None = None) -> dict[int, ModelRisk]:
        """Per model short at some moment (of those `only` selects): how much at its worst,
        and the reservations in term at a moment it is short."""
        found: dict[int, ModelRisk] = {}
        demand = self.sold.demand[self.kept]
        for column, model_id in enumerate(self.fleet.programme.model_ids):
            short = self.per_model[:, column] > np.array(
                [tolerance(total) for total in demand[:, column]]
            )
            if only is not None:
                short &= only
            if not short.any():
                continue
            worst = int(np.argmax(np.where(short, self.per_model[:, column], -1.0)))
            moments = [self.sold.moments[self.kept[k]] for k in np.flatnonzero(short)]
            ids = sorted({pk for t in moments for pk in self.sold.in_term(model_id, t)})
            found[model_id] = ModelRisk(
                model_id=model_id,
                model=self.fleet.model_names[model_id],
                oversold_mu_per_minute=float(self.per_model[worst, column]),
                at=self.sold.moments[self.kept[worst]],
                reservation_ids=ids,
                binding_pools=self.binding_pools[worst],
            )
        return found


def check_group(fleet: JointFleet, sold: SoldMoments, kept: np.ndarray | None = None) -> GroupCheck:
    kept = pareto_moments(sold.demand) if kept is None else kept
    demand = sold.demand[kept]
    if not demand.any():
        zero = np.zeros(demand.shape)
        return GroupCheck(fleet, sold, kept, zero, [[] for _ in kept])
    shortfall = fleet.programme.shortfall(demand)
    return GroupCheck(
        fleet,
        sold,
        kept,
        shortfall.per_model,
        [[fleet.pool_names[pk] for pk in b.pools] for b in shortfall.binding],
    )


# --- A change that may shrink what the fleet serves ---------------------------------------


@contextmanager
def capacity_change(
    *,
    action: str,
    model_ids: Iterable[int] = (),
    pool_ids: Iterable[int] = (),
    force: bool = False,
    reason: str = "",
    obj=None,
) -> Iterator[None]:
    """Run a catalogue or pricing write inside: it is refused (ConflictError, rolled back
    with the caller's transaction) when it leaves more sold MU/min unserved at some moment
    than before, unless forced with a reason. Name every model and pool the write touches,
    before and after (a deployment moved names both pools)."""
    # Named now: a deleted row has no pk once the write ran.
    named = (
        {"object_type": obj._meta.label_lower, "object_id": obj.pk, "object_repr": str(obj)}
        if obj is not None
        else {"object_type": "capacity.capacityrisk"}
    )
    if force and not reason.strip():
        raise DomainError(
            "Forcing a change that puts sold capacity at risk needs a reason (force_reason).",
            field="force_reason",
        )
    pool_ids = list(pool_ids)
    seeds = set(model_ids) | set(
        Deployment.objects.filter(gpu_pool_id__in=pool_ids).values_list(
            "served_model_id", flat=True
        )
    )
    held = lock_models_sharing_pools(seeds)
    now = timezone.now()
    before_fleet = joint_fleet(held, now=now)
    sold = sold_moments(before_fleet, start=now)
    before = check_group(before_fleet, sold)
    yield
    after = check_group(joint_fleet(held, now=now), sold, before.kept)
    slack = np.array([tolerance(total) for total in sold.demand[before.kept].sum(axis=1)])
    worse = after.per_moment > before.per_moment + slack
    if worse.any():
        risks = after.risks(only=worse)
        at_risk = _named_reservations(risks)
        described = _describe(risks)
        if not force:
            raise ConflictError(
                f"This change would leave sold capacity unserved: {described}. "
                f"{at_risk['count']} reservation(s) at risk (ids "
                f"{', '.join(str(r['id']) for r in at_risk['reservations'][:20])}). Send "
                "force=true with a force_reason to make it anyway.",
                code="capacity_at_risk",
                details={
                    "models": [_risk_dict(risk) for risk in risks.values()],
                    "reservations_at_risk": at_risk["reservations"],
                    "reservations_at_risk_count": at_risk["count"],
                },
            )
        audit_record(
            action=f"{action}.forced",
            **named,
            after={
                "models": [_risk_dict(risk) for risk in risks.values()],
                "reservations_at_risk": [r["id"] for r in at_risk["reservations"]],
            },
            reason=reason,
        )
    record_risk(held, now=now, oversold=after.risks())


def _describe(risks: dict[int, ModelRisk]) -> str:
    return "; ".join(
        f"'{risk.model}' short by {risk.oversold_mu_per_minute:.6g} MU/min at "
        f"{risk.at.isoformat()}"
        + (f" (pool {', '.join(risk.binding_pools)})" if risk.binding_pools else "")
        for risk in risks.values()
    )


def _risk_dict(risk: ModelRisk) -> dict:
    return {
        "model": risk.model,
        "oversold_mu_per_minute": risk.oversold_mu_per_minute,
        "at": risk.at.isoformat(),
        "binding_pools": risk.binding_pools,
    }


def _named_reservations(risks: dict[int, ModelRisk]) -> dict:
    ids = sorted({pk for risk in risks.values() for pk in risk.reservation_ids})
    rows = (
        Reservation.objects.filter(pk__in=ids[:MAX_NAMED_RESERVATIONS])
        .select_related("customer", "served_model")
        .order_by("pk")
    )
    return {
        "count": len(ids),
        "reservations": [
            {
                "id": r.pk,
                "customer": r.customer.slug,
                "model": r.served_model.name,
                "mu_per_minute": r.mu_per_minute,
                "starts_at": r.starts_at.isoformat(),
                "ends_at": r.ends_at.isoformat() if r.ends_at else None,
            }
            for r in rows
        ],
    }


# --- The fleet's re-check, every tick ----------------------------------------------------


def fleet_recheck(
    *, now: datetime | None = None, guaranteed_shortfall: dict[int, float] | None = None
) -> dict[int, tuple[float, float]]:
    """Check every group of models that share pools, store each model's state (and the
    tick's guaranteed shortfall, when given) and alert on changes; per model, (oversold,
    guaranteed shortfall) MU/min."""
    now = now or timezone.now()
    model_ids = set(ServedModel.objects.values_list("pk", flat=True))
    oversold: dict[int, ModelRisk] = {}
    for group in components(deployment_edges(), model_ids):
        fleet = joint_fleet(group, now=now)
        sold = sold_moments(fleet, start=now)
        oversold |= check_group(fleet, sold).risks()
    with transaction.atomic():
        record_risk(model_ids, now=now, oversold=oversold, guaranteed=guaranteed_shortfall or {})
    shortfall = guaranteed_shortfall or {}
    return {
        pk: (
            oversold[pk].oversold_mu_per_minute if pk in oversold else 0.0,
            max(0.0, shortfall.get(pk, 0.0)),
        )
        for pk in model_ids
    }


# --- The state, and its alerts -------------------------------------------------------------


def record_risk(
    model_ids: Iterable[int],
    *,
    now: datetime,
    oversold: dict[int, ModelRisk] | None = None,
    guaranteed: dict[int, float] | None = None,
) -> None:
    """Store the models' state as just measured (None: not measured by this caller); a row a
    newer check wrote is left alone. One alert per state entered or left, after commit."""
    ids = sorted(set(model_ids))
    if not ids:
        return
    CapacityRisk.objects.bulk_create(
        [CapacityRisk(served_model_id=pk, checked_at=now) for pk in ids], ignore_conflicts=True
    )
    rows = list(
        CapacityRisk.objects.select_for_update()
        .filter(served_model_id__in=ids)
        .select_related("served_model")
        .order_by("pk")
    )
    alerts = []
    changed = []
    for row in rows:
        if row.checked_at > now:
            continue  # a check that read the database later has written
        if oversold is not None:
            risk = oversold.get(row.pk)
            mu = risk.oversold_mu_per_minute if risk else 0.0
            was = row.oversold
            row.oversold_mu_per_minute = mu
            row.oversold_at = risk.at if risk else None
            row.reservations_at_risk = risk.reservation_ids[:MAX_NAMED_RESERVATIONS] if risk else []
            row.oversold_since = (row.oversold_since or now) if risk else None
            if was != row.oversold:
                alerts.append(_alert(OVERSOLD, row, mu, risk.reservation_ids if risk else [], now))
        if guaranteed is not None:
            mu = max(0.0, guaranteed.get(row.pk, 0.0))
            short = mu > tolerance(mu)
            was = row.short
            row.guaranteed_shortfall_mu_per_minute = mu if short else 0.0
            row.guaranteed_shortfall_since = (
                (row.guaranteed_shortfall_since or now) if short else None
            )
            if was != row.short:
                alerts.append(_alert(GUARANTEED_SHORTFALL, row, mu, [], now))
        row.checked_at = now
        changed.append(row)
    # COPY and one UPDATE: every model's row is written every tick.
    copy_update(
        model=CapacityRisk,
        rows=changed,
        fields=[
            "oversold_mu_per_minute",
            "oversold_at",
            "oversold_since",
            "reservations_at_risk",
            "guaranteed_shortfall_mu_per_minute",
            "guaranteed_shortfall_since",
            "checked_at",
        ],
    )
    for alert in alerts:
        audit_record(
            actor=_actor(),
            action=f"capacity.{alert['kind']}.{alert['state']}",
            obj=next(row.served_model for row in rows if row.pk == alert["model_id"]),
            after={key: value for key, value in alert.items() if key != "model_id"},
        )
        payload = {key: value for key, value in alert.items() if key != "model_id"}
        transaction.on_commit(lambda payload=payload: send_alert(payload))


def _actor() -> str:
    actor = current_actor()
    return actor if actor and actor != "system:unknown" else "system:capacity-recheck"


def _alert(kind: str, row: CapacityRisk, mu: float, reservation_ids: list[int], now) -> dict:
    entered = row.oversold if kind == OVERSOLD else row.short
    customers = sorted(
        set(
            Reservation.objects.filter(pk__in=reservation_ids).values_list(
                "customer__slug", flat=True
            )
        )
    )
    return {
        "model_id": row.pk,
        "kind": kind,
        "state": "entered" if entered else "left",
        "model": row.served_model.name,
        "mu_per_minute": mu,
        "at": now.isoformat(),
        "reservations_at_risk": reservation_ids[:MAX_NAMED_RESERVATIONS],
        "customers": customers,
    }
