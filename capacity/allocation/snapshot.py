"""The allocation policy's input, read from the database in a fixed number of queries whatever
the fleet size: demand (usage rollups and raw events, refusals included), reservations and
the customers allowed on each model, GPU inventory, replica health and readiness as
observed, the workload mix, the requests gateways hold for a model at zero (Redis), and the
engines' own load from Prometheus (docs/design.md#the-tick).

Readiness is observed, never assumed from what was requested: a replica is ready once the
health probes found it serving (`Replica` rows, what gateways route to) for the kinds whose
replicas can be told apart (the process supervisor; Kubernetes pods by selector); starting
and draining counts come from what the data plane reported to the probes. A Kubernetes
workload without a pod selector reports its own ready count, which the tick reads from the
resource before the snapshot (capacity/actuation/observe.py). An endpoint-only
deployment (a webhook, a Kubernetes Service) reports no per-replica readiness: it is ready
while its endpoint answers its probes, less the replicas added within its cold start, which
count as starting. A dry run has nothing to observe: what it asked for is what it has.
"""

import hashlib
import logging
import marshal
import operator
import time
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import numpy as np
from django.conf import settings
from django.db.models import BigIntegerField, Count, Func, Max, Q, Sum
from django.db.models.functions import Coalesce, Trunc

from accounts.models import Customer
from capacity.admission.gateways import gateway_waiting
from capacity.allocation import policy as allocation
from capacity.allocation.bursts import Bursts, bursts
from capacity.allocation.prediction import PredictionReading, prediction_readings
from capacity.allocation.trend import TREND_MINUTES, demand_trend_mu_per_minute_per_second
from capacity.health.probes import unhealthy_replicas_by_deployment
from capacity.models import (
    ActuatorKind,
    AllocationDecision,
    CostModel,
    Deployment,
    Entitlement,
    GpuPool,
    Replica,
    Reservation,
    UsageEvent,
    UsageMinute,
)
from capacity.pricing.cost_models import active_cost_models_by_shape
from capacity.pricing.exchange import DEFAULT_MIX, MeanShape
from capacity.pricing.exchange import replica_mu_per_minute as exchange_rate
from capacity.selling.sellable import MIX_LOOKBACK
from capacity.telemetry.prometheus import DeploymentLoad, read_fleet_load
from core.db import driver_rows

logger = logging.getLogger(__name__)

RECENT_WINDOW = timedelta(seconds=allocation.RECENT_WINDOW_SECONDS)
PEAK_WINDOW = timedelta(seconds=allocation.PEAK_WINDOW_SECONDS)
BURST_WINDOW = timedelta(seconds=allocation.BURST_WINDOW_SECONDS)
NO_BURSTS = Bursts(0.0, 0.0)
IDLE_LOOKBACK = timedelta(days=1)
# What each customer uses and is refused right now, from raw events (rollups lag by a minute
# or more): demand that rises is planned for within a tick, and idle reserved capacity is lent
# to best-effort within two ticks of its traffic stopping.
CURRENT_USE_WINDOW = timedelta(seconds=20)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
MICROS_PER_SECOND = 10**6
MINUTE_MICROS = 60 * MICROS_PER_SECOND


def _micros(moment: datetime) -> int:
    """A moment as whole microseconds since the epoch: exact, so a difference of two divided
    by 10**6 is `timedelta.total_seconds()` to the last bit."""
    return (moment - EPOCH) // MICROSECOND


class EpochMicros(Func):
    """A timestamp as whole microseconds since the epoch, computed by the database: tens of
    thousands of timestamps a tick are read as integers rather than parsed into datetimes."""

    output_field = BigIntegerField()

    def as_postgresql(self, compiler, connection, **extra):
        """The epoch of the timestamp, scaled and cast in SQL."""
        # EXTRACT(EPOCH …) is an exact numeric since PostgreSQL 14.
        return self.as_sql(
            compiler, connection, template="(EXTRACT(EPOCH FROM %(expressions)s) * 1000000)::bigint"
        )

    def as_sqlite(self, compiler, connection, **extra):
        """The timestamp's text read as whole seconds and its microseconds."""
        # Stored as 'YYYY-MM-DD HH:MM:SS[.ffffff]' in UTC; no fraction casts to 0.
        sql, params = compiler.compile(self.source_expressions[0])
        return (
            f"(CAST(strftime('%%s', {sql}) AS INTEGER) * 1000000"
            f" + CAST(substr({sql}, 21, 6) AS INTEGER))",
            (*params, *params),
        )


def _replica_mu(reference: CostModel | None, own: CostModel | None, mix: MeanShape) -> float | None:
    """A replica's MU/min on its own cost model, in the model's reference MU at its request
    mix; None without either cost model (the policy sizes it by its minimum only)."""
    if reference is None or own is None:
        return None
    return exchange_rate(reference=reference, own=own, mix=mix)


class _Demand(NamedTuple):
    """A (model, customer)'s rolled-up use, MU/min: the mean over RECENT_WINDOW and the
    busiest minute of PEAK_WINDOW."""

    recent_mu_per_minute: float
    peak_mu_per_minute: float


class _Refused(NamedTuple):
    """What admission turned away from a (model, customer) lately, MU/min, by the class the
    requests were refused in."""

    guaranteed_mu_per_minute: float
    best_effort_mu_per_minute: float


class _CurrentUse(NamedTuple):
    """A (model, customer) over the last CURRENT_USE_WINDOW, from raw events, MU/min."""

    used_mu_per_minute: float
    refused_guaranteed_mu_per_minute: float
    refused_best_effort_mu_per_minute: float


class _Readiness(NamedTuple):
    """A deployment's running replicas as observed (the module docstring)."""

    ready_replicas: int
    starting_replicas: int
    draining_replicas: int


# Not a NamedTuple: the reservations of a (model, customer) are added up into it, row by row.
@dataclass(slots=True)
class _Reserved:
    """A (model, customer)'s active reservations together: their MU/min, whether one keeps
    the model warm, and when the latest of them started (epoch microseconds)."""

    mu_per_minute: float
    keep_warm: bool
    latest_start_us: int | None


@dataclass(slots=True)
class _CustomerReadings:
    """Everything read per (model, customer), for `_customer_demands`; the customers' tier
    weights by customer."""

    reserved: dict[tuple[int, int], _Reserved]
    demand: dict[tuple[int, int], _Demand]
    refused: dict[tuple[int, int], _Refused]
    current: dict[tuple[int, int], _CurrentUse]
    last_use_us: dict[tuple[int, int], int]
    tier_weights: dict[int, float]


@dataclass(slots=True)
class _FleetReadings:
    """Everything the snapshot reads besides the deployments and the pools, each in one query
    (or one read of Redis or Prometheus) for the whole fleet, by model or deployment."""

    active: dict[tuple[int, int, int], CostModel]  # (model, GPU type, GPUs per replica)
    references: dict[int, CostModel]
    mixes: dict[int, MeanShape]
    mu_per_request: dict[int, float]
    customers: _CustomerReadings
    customers_of: dict[int, set[int]]
    trends: dict[int, float]
    waiting_at_gateways: dict[str, tuple[float, float]]  # model name → (MU, seconds)
    bursts: dict[int, Bursts]
    last_used: dict[int, datetime]
    history: dict[int, list[tuple[float, int]]]
    loads: dict[int, DeploymentLoad]
    readiness: dict[int, _Readiness]
    unhealthy: dict[int, int]


def build_snapshot(*, now: datetime, window_seconds: float | None = None):
    """The policy's input, in a fixed number of queries whatever the fleet size; with the
    deployments by id and the unhealthy replicas per deployment, which the tick adds back to
    the decisions (`with_replacements`, `with_holds`)."""
    window_seconds = window_seconds or settings.ALLOCATION_STABILISATION_SECONDS
    deployments = list(
        Deployment.objects.select_related("served_model", "gpu_pool__gpu_type").order_by("pk")
    )
    # Replicas the probes found unhealthy are being restarted: they hold their GPUs but serve
    # nothing, so the policy plans without them (and `with_replacements` adds them back).
    unhealthy = unhealthy_replicas_by_deployment()
    pools = _pools(deployments, unhealthy)
    fleet = _read_fleet(deployments, unhealthy, now, window_seconds)
    by_model: dict[int, list[Deployment]] = defaultdict(list)
    for deployment in deployments:
        by_model[deployment.served_model_id].append(deployment)
    now_us = _micros(now)
    predictions = prediction_readings(
        now,
        {
            model_id: model_deployments[0].served_model.prediction_enabled
            for model_id, model_deployments in by_model.items()
        },
        {
            model_id: min((d.cold_start_seconds for d in model_deployments), default=0.0)
            for model_id, model_deployments in by_model.items()
        },
        settings.ALLOCATION_TICK_SECONDS,
    )
    models = [
        _with_prediction(
            _model_snapshot(model_id, model_deployments, fleet, now, now_us),
            predictions.get(model_id),
        )
        for model_id, model_deployments in by_model.items()
    ]
    snapshot = allocation.Snapshot(
        models=tuple(models),
        pools=tuple(pools),
        settings=allocation.PolicySettings(stabilisation_window_seconds=window_seconds),
    )
    return snapshot, {d.pk: d for d in deployments}, unhealthy


def _pools(deployments: list[Deployment], unhealthy: dict[int, int]) -> list[allocation.PoolState]:
    """Each pool with the GPUs the policy may place on: its inventory less what unhealthy
    replicas and benchmark-held ones keep (they hold their GPUs, and are no capacity)."""
    held_gpus: dict[int, int] = defaultdict(int)
    for d in deployments:
        # Benchmark-held replicas (`with_holds`) hold their GPUs too, started or not yet.
        held_gpus[d.gpu_pool_id] += (
            min(unhealthy.get(d.pk, 0), d.current_replicas) + d.benchmark_held_replicas
        ) * d.gpus_per_replica
    return [
        allocation.PoolState(pool.pk, pool.name, max(0, pool.gpu_count - held_gpus[pool.pk]))
        for pool in GpuPool.objects.all()
    ]


def _read_fleet(
    deployments: list[Deployment], unhealthy: dict[int, int], now: datetime, window_seconds: float
) -> _FleetReadings:
    """Every reading the models' snapshots are built from: cost models, request mixes,
    reservations, demand and refusals, trends, bursts, waiting requests, past recommendations,
    engine loads, readiness and the customers allowed on each model."""
    whole_minute = now.replace(second=0, microsecond=0)
    active = active_cost_models_by_shape()
    references = _reference_cost_models(deployments, active)
    mixes, mu_per_request = _request_mixes(now)
    reserved = _reservations(now)
    demand, refused = _rolled_up_use(whole_minute)
    current = _current_use(now)
    _add_current_refusals(refused, current)
    last_use_us = _last_use(now)
    trends = _trends(whole_minute)
    waiting_at_gateways = gateway_waiting(now_s=time.time())
    model_bursts = _bursts(now)
    last_used = _last_used_by_model(now)
    history = _recent_recommendations(now, window_seconds)
    loads = _loads(deployments)
    readiness = _readiness(deployments, unhealthy, now)
    customers_of = _customers_of(reserved, demand, refused)
    # Each customer's tier weight: its share of the best-effort slack not split by demand.
    # Every customer's, in one plain query: a filter by the ids seen would send one parameter
    # per customer, whose building costs more than reading the few customers not seen.
    tier_weights = dict(Customer.objects.values_list("pk", "tier__weight"))
    return _FleetReadings(
        active=active,
        references=references,
        mixes=mixes,
        mu_per_request=mu_per_request,
        customers=_CustomerReadings(
            reserved=reserved,
            demand=demand,
            refused=refused,
            current=current,
            last_use_us=last_use_us,
            tier_weights=tier_weights,
        ),
        customers_of=customers_of,
        trends=trends,
        waiting_at_gateways=waiting_at_gateways,
        bursts=model_bursts,
        last_used=last_used,
        history=history,
        loads=loads,
        readiness=readiness,
        unhealthy=unhealthy,
    )


def _reference_cost_models(
    deployments: list[Deployment], active: dict[tuple[int, int, int], CostModel]
) -> dict[int, CostModel]:
    """Model → its reference cost model, the one MU are measured against: the model's
    reference GPU type, fewest GPUs per replica."""
    served_models = {d.served_model_id: d.served_model for d in deployments}
    references: dict[int, CostModel] = {}
    for (model_id, gpu_type_id, _gpus), cost_model in sorted(active.items(), key=lambda i: i[0]):
        served = served_models.get(model_id)
        if served and gpu_type_id == served.reference_gpu_type_id and model_id not in references:
            references[model_id] = cost_model
    return references


def _request_mixes(now: datetime) -> tuple[dict[int, MeanShape], dict[int, float]]:
    """Per model with requests within MIX_LOOKBACK: its mean request shape (what a replica's
    MU/min is exchanged at) and its mean MU per request (what a queued request weighs)."""
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
    return mixes, mu_per_request


def _reservations(now: datetime) -> dict[tuple[int, int], _Reserved]:
    """(model, customer) → its reservations active now, added up: a customer may hold several
    on one model, and keeps the model warm if any of them does."""
    reserved: dict[tuple[int, int], _Reserved] = {}
    for model_id, customer_id, mu, keep_warm, starts_us in driver_rows(
        Reservation.objects.active_at(now)
        .annotate(starts_us=EpochMicros("starts_at"))
        .values_list("served_model_id", "customer_id", "mu_per_minute", "keep_warm", "starts_us")
    ):
        key = (model_id, customer_id)
        entry = reserved.get(key)
        if entry is None:
            reserved[key] = _Reserved(0.0 + mu, keep_warm, starts_us)
        else:
            entry.mu_per_minute += mu
            entry.keep_warm = entry.keep_warm or keep_warm
            if starts_us > entry.latest_start_us:
                entry.latest_start_us = starts_us
    return reserved


def _rolled_up_use(
    whole_minute: datetime,
) -> tuple[dict[tuple[int, int], _Demand], dict[tuple[int, int], _Refused]]:
    """(model, customer) → its demand and, where there were any, its refusals, from the
    complete minutes' rollups (the recent mean and the busiest minute)."""
    recent_minutes = RECENT_WINDOW.total_seconds() / 60
    demand: dict[tuple[int, int], _Demand] = {}
    refused: dict[tuple[int, int], _Refused] = {}
    in_recent = Q(minute__gte=whole_minute - RECENT_WINDOW)
    # Tuples from the driver, not a dict per (model, customer): tens of thousands of rows a tick.
    for model_id, customer_id, recent, peak, refused_mu, refused_guaranteed in driver_rows(
        UsageMinute.objects.filter(minute__gte=whole_minute - PEAK_WINDOW, minute__lt=whole_minute)
        .values("served_model_id", "customer_id")
        .annotate(
            recent=Sum("mu", filter=in_recent),
            peak=Max("mu"),
            refused=Sum("refused_mu", filter=in_recent),
            refused_guaranteed=Sum("guaranteed_refused_mu", filter=in_recent),
        )
        .values_list(
            "served_model_id", "customer_id", "recent", "peak", "refused", "refused_guaranteed"
        )
    ):
        key = (model_id, customer_id)
        demand[key] = _Demand((recent or 0.0) / recent_minutes, peak or 0.0)
        guaranteed_refused = (refused_guaranteed or 0.0) / recent_minutes
        all_refused = (refused_mu or 0.0) / recent_minutes
        if all_refused > 0:
            refused[key] = _Refused(guaranteed_refused, max(0.0, all_refused - guaranteed_refused))
    return demand, refused


def _add_current_refusals(
    refused: dict[tuple[int, int], _Refused], current: dict[tuple[int, int], _CurrentUse]
) -> None:
    """Refusals of the last seconds count before their minute is rolled up: each class's
    refused rate is the higher of the rollups' and the raw events'."""
    for key, (_used, guaranteed_now, best_effort_now) in current.items():
        rolled = refused.get(key, _NO_ROLLED_REFUSAL)
        refused[key] = _Refused(max(rolled[0], guaranteed_now), max(rolled[1], best_effort_now))


def _last_used_by_model(now: datetime) -> dict[int, datetime]:
    """Model → the start of its last minute with a request, within IDLE_LOOKBACK (how long
    it has been idle)."""
    return dict(
        UsageMinute.objects.filter(minute__gte=now - IDLE_LOOKBACK, requests__gt=0)
        .values("served_model_id")
        .annotate(last=Max("minute"))
        .values_list("served_model_id", "last")
    )


def _recent_recommendations(
    now: datetime, window_seconds: float
) -> dict[int, list[tuple[float, int]]]:
    """Deployment → (seconds ago, recommended replicas) of the live ticks inside the
    stabilisation window, which a scale-down waits out."""
    now_us = _micros(now)
    history: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for deployment_id, created_us, recommended in driver_rows(
        AllocationDecision.objects.filter(
            created_at__gte=now - timedelta(seconds=window_seconds), dry_run=False
        )
        .annotate(created_us=EpochMicros("created_at"))
        .values_list("deployment_id", "created_us", "recommended_replicas")
    ):
        history[deployment_id].append(((now_us - created_us) / MICROS_PER_SECOND, recommended))
    return history


def _customers_of(
    reserved: dict[tuple[int, int], _Reserved],
    demand: dict[tuple[int, int], _Demand],
    refused: dict[tuple[int, int], _Refused],
) -> dict[int, set[int]]:
    """Model → the customers the policy plans for on it: those with a reservation, use or
    refusals, and every customer allowed on it, history or not (each gets a best-effort
    share)."""
    customers_of: dict[int, set[int]] = defaultdict(set)
    entitled = Entitlement.objects.values_list("served_model_id", "customer_id")
    for model_id, customer_id in [*reserved, *demand, *refused, *entitled]:
        customers_of[model_id].add(customer_id)
    return customers_of


def _model_snapshot(
    model_id: int,
    model_deployments: list[Deployment],
    fleet: _FleetReadings,
    now: datetime,
    now_us: int,
) -> allocation.ModelSnapshot:
    """One model as the policy reads it: its deployments, its customers' demands, and the
    model-wide signals (idleness, queues, bursts, waiting requests, engine load, trend)."""
    loads = fleet.loads
    customers = tuple(
        _customer_demands(
            model_id, sorted(fleet.customers_of.get(model_id, ())), now_us, fleet.customers
        )
    )
    served_model = model_deployments[0].served_model
    engine_loads = [
        loads[d.pk].mu_per_minute
        for d in model_deployments
        if d.pk in loads and loads[d.pk].known and loads[d.pk].mu_per_minute is not None
    ]
    last = fleet.last_used.get(model_id)
    burst = fleet.bursts.get(model_id, NO_BURSTS)
    held_mu, held_seconds = fleet.waiting_at_gateways.get(served_model.name, (0.0, 0.0))
    return allocation.ModelSnapshot(
        model_id=model_id,
        name=served_model.name,
        customers=customers,
        deployments=_deployment_states(model_id, model_deployments, fleet),
        idle_seconds=(now - last).total_seconds() if last else None,
        load_known=all(loads[d.pk].known if d.pk in loads else True for d in model_deployments),
        waiting_mu=_waiting_mu(model_deployments, loads, fleet.mu_per_request.get(model_id)),
        burst_mu_per_minute=burst.burst_mu_per_minute,
        burst_window_busiest_minute_mu=burst.busiest_minute_mu,
        gateway_waiting_mu=held_mu,
        engine_mu_per_minute=sum(engine_loads) if engine_loads else None,
        demand_trend_mu_per_minute_per_second=fleet.trends.get(model_id, 0.0),
        best_effort_ceiling_mu_per_minute=served_model.best_effort_ceiling_mu_per_minute,
        best_effort_ceiling_replicas=served_model.best_effort_ceiling_replicas,
        gateway_waiting_seconds=held_seconds,
    )


def _with_prediction(
    model: allocation.ModelSnapshot, reading: PredictionReading | None
) -> allocation.ModelSnapshot:
    """Rule 3c's inputs (capacity.allocation.prediction) on the model's snapshot."""
    if reading is None:
        return model
    return replace(
        model,
        prediction_enabled=reading.enabled,
        history_seconds=reading.history_seconds,
        slo_target=settings.ALLOCATION_SLO_TARGET,
        delivered_slo_attainment=reading.delivered_attainment,
        delivered_requests=reading.delivered_requests,
        slo_correction_in_force=reading.correction_in_force,
        forecast_now_mu_per_minute=reading.forecast.at_level_mu_per_minute,
        forecast_ahead_mu_per_minute=reading.forecast.ahead_mu_per_minute,
        forecast_next_hour_peak_mu_per_minute=reading.forecast.next_hour_peak_mu_per_minute,
    )


def _deployment_states(
    model_id: int, model_deployments: list[Deployment], fleet: _FleetReadings
) -> tuple[allocation.DeploymentState, ...]:
    """The model's deployments as the policy reads them, each sized at its own cost model's
    rate in the model's reference MU and request mix."""
    mix = fleet.mixes.get(model_id, DEFAULT_MIX)
    reference = fleet.references.get(model_id)
    # The model's deployments share a few cost models: each rate computed once.
    replica_mu: dict[int | None, float | None] = {}
    states = []
    for d in model_deployments:
        own = fleet.active.get((model_id, d.gpu_pool.gpu_type_id, d.gpus_per_replica))
        own_pk = own.pk if own is not None else None
        if own_pk not in replica_mu:
            replica_mu[own_pk] = _replica_mu(reference, own, mix)
        states.append(_deployment_state(d, replica_mu[own_pk], fleet))
    return tuple(states)


def _deployment_state(
    d: Deployment, mu_per_minute_per_replica: float | None, fleet: _FleetReadings
) -> allocation.DeploymentState:
    """One deployment as the policy plans it: without its unhealthy replicas (being
    restarted) and those a benchmark holds, which are no capacity."""
    broken = min(fleet.unhealthy.get(d.pk, 0), d.current_replicas)
    # Benchmark-held replicas are no capacity: the running ones leave current, all of
    # them leave the room under max (`with_holds` adds them back to the target).
    held = d.benchmark_held_replicas
    running_held = min(held, d.current_replicas - broken)
    room = max(0, d.max_replicas - broken - held)
    ready, starting, draining = fleet.readiness[d.pk]
    return allocation.DeploymentState(
        deployment_id=d.pk,
        name=d.name,
        pool_id=d.gpu_pool_id,
        gpus_per_replica=d.gpus_per_replica,
        mu_per_minute_per_replica=mu_per_minute_per_replica,
        current_replicas=d.current_replicas - broken - running_held,
        ready_replicas=ready,
        starting_replicas=starting,
        draining_replicas=draining,
        min_replicas=min(d.min_replicas, room),
        max_replicas=room,
        cold_start_seconds=d.cold_start_seconds,
        scale_to_zero_after_seconds=d.scale_to_zero_after_seconds,
        target_utilisation=d.target_utilisation,
        cost_per_hour_usd=float(d.gpu_pool.gpu_type.hourly_cost_usd) * d.gpus_per_replica,
        recent_recommendations=tuple(fleet.history.get(d.pk, ())),
    )


_NO_RESERVATION = _Reserved(0.0, False, None)
_NO_DEMAND = _Demand(0.0, 0.0)
_NO_CURRENT = _CurrentUse(0.0, 0.0, 0.0)
# Integers, as ever: the digest marshals the customers' values, where 0 and 0.0 differ.
_NO_REFUSAL = _Refused(0, 0)
_NO_ROLLED_REFUSAL = _Refused(0.0, 0.0)


def _customer_demands(
    model_id: int, customer_ids: list[int], now_us: int, readings: _CustomerReadings
) -> list[allocation.CustomerDemand]:
    """Each customer's demand on one model, each lookup done once (tens of thousands a tick,
    in one loop: a call per customer cost as much as the lookups)."""
    demands = []
    append = demands.append
    customer_demand = allocation.CustomerDemand
    reserved_get, demand_get, current_get = (
        readings.reserved.get,
        readings.demand.get,
        readings.current.get,
    )
    refused_get, last_use_get, weight_get = (
        readings.refused.get,
        readings.last_use_us.get,
        readings.tier_weights.get,
    )
    for customer_id in customer_ids:
        key = (model_id, customer_id)
        reservation = reserved_get(key, _NO_RESERVATION)
        recent, peak = demand_get(key, _NO_DEMAND)
        used_now = current_get(key, _NO_CURRENT)[0]
        refused_guaranteed, refused_best_effort = refused_get(key, _NO_REFUSAL)
        # Since the customer last used the model or its reservation started, the later.
        if used_now > 0:
            idle = 0.0
        else:
            started = reservation.latest_start_us
            last = last_use_get(key)
            if last is not None:
                # A rollup's minute is its start: the use it counts lasted until its end.
                last += MINUTE_MICROS
                if started is None or last > started:
                    started = last
            idle = None if started is None else max(0.0, (now_us - started) / MICROS_PER_SECOND)
        append(
            customer_demand(
                customer_id,
                reservation.mu_per_minute,
                # The last seconds' use is a floor: rising demand counts before it is rolled up.
                max(recent, used_now),
                peak,
                reservation.keep_warm,
                refused_guaranteed,
                refused_best_effort,
                idle,
                used_now,
                weight_get(customer_id, 1.0),
            )
        )
    return demands


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


def with_holds(decisions: allocation.Decisions, deployments: dict) -> allocation.Decisions:
    """Add the replicas benchmark runs hold back to what the policy planned without them
    (benchmarking/isolation.py): the target includes them, started or still to start, so the
    policy never counts them as capacity and never scales them away. Call after
    `with_replacements` (which has added the unhealthy ones back)."""
    result = []
    for decision in decisions.deployments:
        deployment = deployments[decision.deployment_id]
        held = deployment.benchmark_held_replicas
        if held:
            decision = replace(
                decision,
                # The policy planned without the held replicas already running. Its
                # recommendation stays the customers' own: the stabilisation window reads
                # past recommendations, and must not hold the extra replicas after the run.
                current_replicas=deployment.current_replicas,
                target_replicas=decision.target_replicas + held,
                reasons=(
                    *decision.reasons,
                    allocation.Reason(
                        "benchmark_hold",
                        f"{held} replica(s) held by a benchmark run: outside the gateways' "
                        "rotation and the capacity, kept until the run ends",
                        {"held": held},
                    ),
                ),
            )
        result.append(decision)
    return replace(decisions, deployments=tuple(result))


def _current_use(now: datetime) -> dict[tuple[int, int], _CurrentUse]:
    """(model, customer) → MU/min over the last CURRENT_USE_WINDOW, from raw events: used,
    refused in the guaranteed class, refused best-effort."""
    minutes = CURRENT_USE_WINDOW.total_seconds() / 60
    refused = Q(outcome="refused")
    rows = (
        UsageEvent.objects.filter(started_at__gte=now - CURRENT_USE_WINDOW, started_at__lt=now)
        .values("served_model_id", "customer_id")
        .annotate(
            used=Sum("mu", filter=~refused),
            guaranteed=Sum("estimated_mu", filter=refused & Q(admission_class="guaranteed")),
            # Not the refusals of the customer's own request limits (class "none"): more
            # capacity would not admit them.
            best_effort=Sum("estimated_mu", filter=refused & Q(admission_class="best_effort")),
        )
        .values_list("served_model_id", "customer_id", "used", "guaranteed", "best_effort")
    )
    return {
        (model_id, customer_id): _CurrentUse(
            (u or 0.0) / minutes, (g or 0.0) / minutes, (b or 0.0) / minutes
        )
        for model_id, customer_id, u, g, b in rows
    }


def _last_use(now: datetime) -> dict[tuple[int, int], int]:
    """(model, customer) → the start of the last minute with a request that ran, within
    IDLE_LOOKBACK, in epoch microseconds."""
    return {
        (model_id, customer_id): last
        for model_id, customer_id, last in driver_rows(
            UsageMinute.objects.filter(minute__gte=now - IDLE_LOOKBACK, requests__gt=0)
            .values("served_model_id", "customer_id")
            .annotate(last=EpochMicros(Max("minute")))
            .values_list("served_model_id", "customer_id", "last")
        )
    }


def _trends(whole_minute: datetime) -> dict[int, float]:
    """Model → its demand's trend (capacity.allocation.trend) over the last TREND_MINUTES
    complete minutes of its rollups: served plus refused MU per minute."""
    since = whole_minute - timedelta(minutes=TREND_MINUTES)
    series: dict[int, list[float]] = {}
    for model_id, minute, mu, refused_mu in (
        UsageMinute.objects.filter(minute__gte=since, minute__lt=whole_minute)
        .values("served_model_id", "minute")
        .annotate(mu=Sum("mu"), refused_mu=Sum("refused_mu"))
        .values_list("served_model_id", "minute", "mu", "refused_mu")
    ):
        index = int((minute - since).total_seconds() // 60)
        if 0 <= index < TREND_MINUTES:
            values = series.setdefault(model_id, [0.0] * TREND_MINUTES)
            values[index] += (mu or 0.0) + (refused_mu or 0.0)
    return {
        model_id: demand_trend_mu_per_minute_per_second(values)
        for model_id, values in series.items()
    }


def _per_replica_kind(deployment: Deployment) -> bool:
    """Whether the data plane tells this deployment's replicas apart (so the probes see
    each one): the process supervisor, and Kubernetes when pods are listed by selector."""
    if deployment.actuator_kind == ActuatorKind.PROCESS:
        return True
    config = deployment.actuator_config if isinstance(deployment.actuator_config, dict) else {}
    return deployment.actuator_kind == ActuatorKind.KUBERNETES and bool(config.get("pod_selector"))


def _readiness(
    deployments: list[Deployment], unhealthy: dict[int, int], now: datetime
) -> dict[int, _Readiness]:
    """Deployment → its ready, starting and draining replicas as observed (the module
    docstring)."""
    serving = dict(
        # A replica a benchmark holds serves no customer.
        Replica.objects.filter(
            state=Replica.State.HEALTHY,
            last_ok_at__isnull=False,
            held_by_benchmark_run_id__isnull=True,
        )
        .values("deployment_id")
        .annotate(n=Count("id"))
        .values_list("deployment_id", "n")
    )
    endpoint_only = [
        d
        for d in deployments
        if d.actuator_kind != ActuatorKind.DRY_RUN and not _per_replica_kind(d)
    ]
    added_lately: dict[int, int] = defaultdict(int)
    if endpoint_only:
        longest = max(d.cold_start_seconds for d in endpoint_only)
        cold_start = {d.pk: d.cold_start_seconds for d in endpoint_only}
        for deployment_id, applied_at, current, target in AllocationDecision.objects.filter(
            deployment_id__in=list(cold_start),
            actuator_ok=True,
            applied_at__gte=now - timedelta(seconds=longest),
        ).values_list("deployment_id", "applied_at", "current_replicas", "target_replicas"):
            if (now - applied_at).total_seconds() < cold_start[deployment_id]:
                added_lately[deployment_id] += max(0, target - current)
    fresh = timedelta(
        seconds=3 * settings.HEALTH_PROBE_INTERVAL_SECONDS + settings.HEALTH_PROBE_TIMEOUT_SECONDS
    )
    readiness = {}
    for d in deployments:
        running = d.current_replicas - min(unhealthy.get(d.pk, 0), d.current_replicas)
        running -= min(d.benchmark_held_replicas, running)
        observed = d.replicas_observed_at is not None and now - d.replicas_observed_at <= fresh
        if d.actuator_kind == ActuatorKind.DRY_RUN:
            ready = running
        elif _per_replica_kind(d):
            ready = min(running, serving.get(d.pk, 0))
        elif (
            d.actuator_kind == ActuatorKind.KUBERNETES
            and observed
            and d.observed_ready_replicas is not None
        ):
            # The workload's own ready count, read by this tick (capacity/actuation/observe.py).
            ready = min(running, d.observed_ready_replicas)
        else:
            ready = max(0, running - added_lately[d.pk]) if serving.get(d.pk) else 0
        draining = (d.observed_draining_replicas or 0) if observed else 0
        readiness[d.pk] = _Readiness(ready, max(0, running - ready), draining)
    return readiness


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
        # A refused request is part of the burst it arrived in, at its estimated MU: the
        # burst the fleet did not serve is the one it must plan for.
        .annotate(mu=Sum(Coalesce("estimated_mu", "mu")))
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
    Prometheus is configured; without it metered usage is the only load signal and counts as
    known."""
    if not settings.PROMETHEUS_URL or not deployments:
        return {}
    try:
        return read_fleet_load(deployments)
    except Exception:  # an unreadable fleet is an unknown load, never a reason to scale down
        logger.exception("reading the fleet's load from Prometheus failed")
        return {d.pk: DeploymentLoad.unknown(d.pk, "Prometheus unreadable", 0) for d in deployments}


# Each customer's field values, in field order, read in C.
_CUSTOMER_VALUES = operator.attrgetter(*(f.name for f in fields(allocation.CustomerDemand)))


def digest(model: allocation.ModelSnapshot) -> str:
    """SHA-256 of everything the policy read for one model. The model's own fields and its
    deployments by their repr (deterministic); its customers, thousands on a busy model, as
    one marshalled list of value tuples: their dataclass repr was a tenth of the tick.
    marshal version 2 writes no back-references, so equal values give equal bytes whatever
    objects they are."""
    hasher = hashlib.sha256(repr(replace(model, customers=())).encode())
    hasher.update(marshal.dumps([_CUSTOMER_VALUES(c) for c in model.customers], 2))
    return hasher.hexdigest()
