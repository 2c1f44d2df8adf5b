"""How much of a model the fleet can deploy and sell, in the model's MU per minute
(docs/design.md#the-currency).

A replica of the model's reference GPU type mints R = 100 MU/min by definition. A replica of
another deployment mints R · t_ref(w) / t_dep(w), with t the replica-seconds its cost model
predicts for the workload mix w (the mean request of the last hour, or a default mix).

Deployable capacity is the model's alone: each pool's GPUs go to the model's deployments
there best MU per GPU first, each up to its max replicas, as if no other model used the pool.

Sellable capacity is joint: models that share a pool (directly or through other models)
compete for its GPUs, so what a model can sell is what remains *given the other models'
sales*, in whole replicas, found by the programmes of `capacity.selling.feasibility` over the
group of models that share pools with it (`models_sharing_pools`). Selling locks that whole
group's rows (`lock_models_sharing_pools`), in id order.
"""

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from capacity.models import CostModel, Deployment, Reservation, ServedModel, UsageMinute
from capacity.pricing.cost_models import (
    active_cost_model,
    active_cost_models_by_shape,
    cost_models,
)
from capacity.pricing.exchange import DEFAULT_MIX, MeanShape
from capacity.pricing.exchange import replica_mu_per_minute as exchange_rate
from capacity.selling.feasibility import (
    WHOLE_REPLICAS_SECONDS,
    Available,
    PoolSpec,
    Programme,
    UnitSpec,
    components,
    connected_models,
    demand_matrix,
    pareto_moments,
    tolerance,
)

logger = logging.getLogger(__name__)

MIX_LOOKBACK = timedelta(hours=1)


@dataclass(frozen=True)
class DeploymentCapacity:
    deployment_id: int
    name: str
    gpu_pool: str
    gpus_per_replica: int
    deployable_replicas: int
    current_replicas: int
    mu_per_minute_per_replica: float | None
    deployable_mu_per_minute: float
    hot_mu_per_minute: float
    note: str = ""


@dataclass(frozen=True)
class ModelCapacity:
    served_model_id: int
    model: str
    deployable_mu_per_minute: float
    hot_mu_per_minute: float
    # What the model could have sold now, given the other models' sales now (the LP).
    sellable_mu_per_minute: float
    headroom: float
    overcommit: float
    mix: MeanShape
    reference_cost_model_id: int | None
    deployments: list[DeploymentCapacity] = field(default_factory=list)
    # What an open-ended sale starting now could still take, at every later moment too.
    available_mu_per_minute: float = 0.0


def workload_mix(served_model: ServedModel, *, now=None) -> MeanShape:
    """The mean request of the last hour, from the minute rollups; the default mix if none."""
    now = now or timezone.now()
    totals = UsageMinute.objects.filter(
        served_model=served_model, minute__gte=now - MIX_LOOKBACK
    ).aggregate(
        requests=Sum("requests"),
        input_tokens=Sum("input_tokens"),
        cached=Sum("cached_input_tokens"),
        output_tokens=Sum("output_tokens"),
    )
    mix = MeanShape.of_totals(
        requests=totals["requests"] or 0,
        input_tokens=totals["input_tokens"] or 0,
        cached_input_tokens=totals["cached"] or 0,
        output_tokens=totals["output_tokens"] or 0,
    )
    return mix or DEFAULT_MIX


def replica_mu_per_minute(
    *,
    deployment: Deployment,
    reference: CostModel,
    mix: MeanShape,
    active: dict[tuple[int, int], CostModel] | None = None,
) -> tuple[float | None, str]:
    """MU/min one replica of the deployment mints, and why when it cannot be known. `active`:
    the model's active cost models by (GPU type, GPUs per replica), when the caller read them."""
    gpu_type = deployment.gpu_pool.gpu_type
    if active is not None:
        own = active.get((gpu_type.pk, deployment.gpus_per_replica))
    else:
        own = active_cost_model(
            served_model=deployment.served_model,
            gpu_type=gpu_type,
            gpus_per_replica=deployment.gpus_per_replica,
        )
    if own is None:
        return None, (
            f"no active cost model for {gpu_type.name}×{deployment.gpus_per_replica}: "
            "benchmark this deployment to sell it"
        )
    rate = exchange_rate(reference=reference, own=own, mix=mix)
    if rate is None:
        return None, "the cost models predict no time for the workload mix"
    return rate, ""


def model_capacity(
    served_model: ServedModel, *, now=None, joint: "JointCapacity | None" = None
) -> ModelCapacity:
    """`joint`: the model's joint figures when the caller computed them for many models."""
    now = now or timezone.now()
    if joint is None:
        joint = joint_capacity([served_model.pk], now=now)[served_model.pk]
    reference = active_cost_model(served_model=served_model)
    mix = workload_mix(served_model, now=now)
    deployments = list(
        Deployment.objects.filter(served_model=served_model).select_related(
            "gpu_pool__gpu_type", "served_model"
        )
    )
    # Every active version of the model in one query (one per deployment before): there is
    # one per (GPU type, GPUs per replica).
    active = {
        (c.gpu_type_id, c.gpus_per_replica): c
        for c in cost_models().filter(served_model=served_model, status=CostModel.Status.ACTIVE)
    }
    per_replica: dict[int, tuple[float | None, str]] = {}
    for deployment in deployments:
        if reference is None:
            per_replica[deployment.pk] = (
                None,
                f"no active cost model on the reference GPU type "
                f"{served_model.reference_gpu_type.name}: nothing is sellable",
            )
        else:
            per_replica[deployment.pk] = replica_mu_per_minute(
                deployment=deployment, reference=reference, mix=mix, active=active
            )

    results: list[DeploymentCapacity] = []
    by_pool: dict[int, list[Deployment]] = {}
    for deployment in deployments:
        by_pool.setdefault(deployment.gpu_pool_id, []).append(deployment)
    for pool_deployments in by_pool.values():
        free_gpus = pool_deployments[0].gpu_pool.gpu_count

        def mu_per_gpu(deployment: Deployment) -> float:
            mu, _ = per_replica[deployment.pk]
            return (mu or 0.0) / deployment.gpus_per_replica

        for deployment in sorted(pool_deployments, key=mu_per_gpu, reverse=True):
            mu, note = per_replica[deployment.pk]
            replicas = 0
            if mu:
                replicas = min(deployment.max_replicas, free_gpus // deployment.gpus_per_replica)
                free_gpus -= replicas * deployment.gpus_per_replica
            results.append(
                DeploymentCapacity(
                    deployment_id=deployment.pk,
                    name=deployment.name,
                    gpu_pool=deployment.gpu_pool.name,
                    gpus_per_replica=deployment.gpus_per_replica,
                    deployable_replicas=replicas,
                    current_replicas=deployment.current_replicas,
                    mu_per_minute_per_replica=mu,
                    deployable_mu_per_minute=replicas * (mu or 0.0),
                    hot_mu_per_minute=deployment.current_replicas * (mu or 0.0),
                    note=note,
                )
            )
    deployable = sum(d.deployable_mu_per_minute for d in results)
    return ModelCapacity(
        served_model_id=served_model.pk,
        model=served_model.name,
        deployable_mu_per_minute=deployable,
        hot_mu_per_minute=sum(d.hot_mu_per_minute for d in results),
        sellable_mu_per_minute=joint.sellable_mu_per_minute,
        available_mu_per_minute=joint.available_mu_per_minute,
        headroom=served_model.headroom,
        overcommit=served_model.overcommit,
        mix=mix,
        reference_cost_model_id=reference.pk if reference else None,
        deployments=sorted(results, key=lambda d: d.name),
    )


# --- Joint sellability: the models that share pools, as one linear programme ----------------


def deployment_edges() -> list[tuple[int, int]]:
    """(model, pool) of every deployment: the graph whose components compete for GPUs."""
    return list(Deployment.objects.values_list("served_model_id", "gpu_pool_id"))


def models_sharing_pools(model_ids: Iterable[int]) -> set[int]:
    """The models, and every model that shares a pool with them, directly or not."""
    return connected_models(deployment_edges(), model_ids)


def lock_models_sharing_pools(model_ids: Iterable[int]) -> list[int]:
    """Lock the rows of the models and of every model sharing a pool with them (to the end of
    the transaction), in id order so that two sellers never wait on each other; returns the
    ids held. A catalogue change that joins two groups locks both first (capacity.selling.
    at_risk), so the group read after the lock is the one that holds; if it grew in between
    (such a change committed just before), the newcomers are locked too."""
    held: set[int] = set()
    seeds = set(model_ids)
    edges = deployment_edges()
    while True:
        missing = (connected_models(edges, seeds | held) | seeds) - held
        if not missing:
            return sorted(held)
        list(
            ServedModel.objects.select_for_update()
            .filter(pk__in=missing)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        held |= missing
        # Read again under the lock: the group that holds is the one read now.
        edges = deployment_edges()


@dataclass(frozen=True)
class JointFleet:
    """The programme of a group of models, with the names its answers are reported in."""

    programme: Programme
    model_names: dict[int, str]
    pool_names: dict[int, str]
    deployment_names: dict[int, str]


def joint_fleet(model_ids: Iterable[int], *, now: datetime | None = None) -> JointFleet:
    """The programme of the models' deployments, in a fixed number of queries (plain rows, not
    model instances: a sale reads every deployment of the group)."""
    now = now or timezone.now()
    ids = sorted(set(model_ids))
    models = {
        pk: (name, reference_gpu_type_id, headroom, overcommit)
        for pk, name, reference_gpu_type_id, headroom, overcommit in ServedModel.objects.filter(
            pk__in=ids
        ).values_list("pk", "name", "reference_gpu_type_id", "headroom", "overcommit")
    }
    deployments = list(
        Deployment.objects.filter(served_model_id__in=ids)
        .order_by("pk")
        .values_list(
            "pk",
            "name",
            "served_model_id",
            "gpu_pool_id",
            "gpu_pool__name",
            "gpu_pool__gpu_count",
            "gpu_pool__gpu_type_id",
            "gpus_per_replica",
            "max_replicas",
        )
    )
    active = active_cost_models_by_shape(served_model_ids=ids)
    # The reference cost model: the model's reference GPU type, fewest GPUs per replica
    # (as `active_cost_model` and the allocation snapshot choose it).
    references: dict[int, CostModel] = {}
    for (model_id, gpu_type_id, _gpus), cost_model in sorted(active.items(), key=lambda i: i[0]):
        model = models.get(model_id)
        if model and gpu_type_id == model[1] and model_id not in references:
            references[model_id] = cost_model
    mixes = _mixes(ids, now)
    pools: dict[int, PoolSpec] = {}
    units = []
    for pk, name, model_id, pool_id, pool_name, gpu_count, gpu_type_id, gpus, most in deployments:
        _, _, headroom, overcommit = models[model_id]
        pools[pool_id] = PoolSpec(pool_id, pool_name, gpu_count)
        reference = references.get(model_id)
        own = active.get((model_id, gpu_type_id, gpus))
        minted = None
        if reference is not None and own is not None:
            minted = exchange_rate(
                reference=reference, own=own, mix=mixes.get(model_id, DEFAULT_MIX)
            )
        units.append(
            UnitSpec(
                deployment_id=pk,
                name=name,
                model_id=model_id,
                pool_id=pool_id,
                gpus_per_replica=gpus,
                max_replicas=most,
                sellable_mu_per_minute_per_replica=(minted or 0.0) * (1 - headroom) * overcommit,
            )
        )
    return JointFleet(
        programme=Programme(pools=list(pools.values()), units=units, model_ids=ids),
        model_names={pk: model[0] for pk, model in models.items()},
        pool_names={pk: pool.name for pk, pool in pools.items()},
        deployment_names={row[0]: row[1] for row in deployments},
    )


def _mixes(model_ids: list[int], now: datetime) -> dict[int, MeanShape]:
    """Each model's mean request of the last hour (`workload_mix`, for many models at once)."""
    mixes = {}
    for row in (
        UsageMinute.objects.filter(served_model_id__in=model_ids, minute__gte=now - MIX_LOOKBACK)
        .values("served_model_id")
        .annotate(
            requests=Sum("requests"),
            inp=Sum("input_tokens"),
            cached=Sum("cached_input_tokens"),
            out=Sum("output_tokens"),
        )
    ):
        mix = MeanShape.of_totals(
            requests=row["requests"] or 0,
            input_tokens=row["inp"] or 0,
            cached_input_tokens=row["cached"] or 0,
            output_tokens=row["out"] or 0,
        )
        if mix is not None:
            mixes[row["served_model_id"]] = mix
    return mixes


@dataclass(frozen=True)
class SoldMoments:
    """What the group has sold at each moment that matters in a span."""

    moments: list[datetime]
    demand: np.ndarray  # moments × the programme's models, MU/min
    # (reservation id, model id, start, end or None, MU/min), times in Unix seconds
    terms: list[tuple[int, int, float, float | None, float]]

    def in_term(self, model_id: int, moment: datetime) -> list[int]:
        """Ids of the model's reservations in term at the moment."""
        t = moment.timestamp()
        return [
            pk
            for pk, model, start, end, _ in self.terms
            if model == model_id and start <= t and (end is None or end > t)
        ]


# The group's terms in Unix seconds, straight from PostgreSQL: a sale reads thousands, and
# parsing their timestamps into datetimes cost more than the linear programme.
_TERMS_SQL = """
SELECT id, served_model_id, extract(epoch FROM starts_at)::float8,
       extract(epoch FROM ends_at)::float8, mu_per_minute
FROM capacity_reservation
WHERE served_model_id = ANY(%(models)s) AND status <> 'cancelled'
  AND (ends_at IS NULL OR ends_at > %(start)s)
  AND (%(end)s::timestamptz IS NULL OR starts_at < %(end)s::timestamptz)
  AND id <> %(exclude)s
"""


def _terms(model_ids, start, end, exclude_id) -> list[tuple[int, int, float, float | None, float]]:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                _TERMS_SQL,
                {
                    "models": list(model_ids),
                    "start": start,
                    "end": end,
                    "exclude": exclude_id if exclude_id is not None else -1,
                },
            )
            return cursor.fetchall()
    rows = (
        Reservation.objects.filter(served_model_id__in=model_ids)
        .not_cancelled()
        .overlapping(start, end)
    )
    if exclude_id is not None:
        rows = rows.exclude(pk=exclude_id)
    return [
        (pk, model_id, s.timestamp(), e.timestamp() if e else None, mu)
        for pk, model_id, s, e, mu in rows.values_list(
            "pk", "served_model_id", "starts_at", "ends_at", "mu_per_minute"
        )
    ]


def sold_moments(
    fleet: JointFleet,
    *,
    start: datetime,
    end: datetime | None = None,
    exclude_id: int | None = None,
) -> SoldMoments:
    """The reservations of the group's models that overlap [start, end), not cancelled, as
    the MU/min sold of each model at `start` and at every start of a reservation after it."""
    terms = _terms(fleet.programme.model_ids, start, end, exclude_id)
    moments, demand = demand_matrix(
        model_index=fleet.programme.model_index,
        terms=[(model_id, s, e, mu) for _, model_id, s, e, mu in terms],
        start=start.timestamp(),
        end=end.timestamp() if end else None,
    )
    return SoldMoments(
        moments=[datetime.fromtimestamp(t, tz=UTC) for t in moments],
        demand=demand,
        terms=terms,
    )


def _kept(demand: np.ndarray) -> np.ndarray:
    return np.arange(1) if demand.shape[0] == 1 else pareto_moments(demand)


def whole_available(
    fleet: JointFleet,
    demand: np.ndarray,
    model_id: int,
    *,
    seconds: float = WHOLE_REPLICAS_SECONDS,
) -> Available:
    """The most MU/min an open-ended addition to the model gets in whole replicas at every
    moment (rows of `demand`, none dominated by another), its moment, and what binds there
    (the relaxation's duals). The relaxation's answer when whole replicas stay undecided in
    `seconds` (none: the relaxation's at once)."""
    programme = fleet.programme
    relaxed = programme.available(demand, model_id)
    if relaxed.mu_per_minute is None or seconds <= 0:
        return relaxed  # the others' sales do not fit even in split replicas
    whole = programme.whole_available(demand, model_id, hint=relaxed.moment_index, seconds=seconds)
    if whole is None:
        logger.warning(
            "whole replicas undecided in %.1f s for %s (%d moments): the relaxation's %s MU/min",
            seconds,
            fleet.model_names.get(model_id, model_id),
            demand.shape[0],
            relaxed.mu_per_minute,
        )
        return relaxed
    value, row = whole
    binding = (
        relaxed.binding
        if row == relaxed.moment_index
        else programme.available(demand[row : row + 1], model_id).binding
    )
    return Available(value, row, binding)


def available_for(
    fleet: JointFleet,
    sold: SoldMoments,
    model_id: int,
    *,
    seconds: float = WHOLE_REPLICAS_SECONDS,
) -> Available:
    """The most MU/min an open-ended addition to the model fits at every moment of `sold`, in
    whole replicas (checked at every moment that no other dominates); its moment indexes
    `sold.moments`."""
    kept = _kept(sold.demand)
    found = whole_available(fleet, sold.demand[kept], model_id, seconds=seconds)
    return Available(found.mu_per_minute, int(kept[found.moment_index]), found.binding)


def fits(fleet: JointFleet, sold: SoldMoments, model_id: int, mu_per_minute: float) -> bool:
    """Whether adding `mu_per_minute` to the model leaves every moment servable in whole
    replicas: at the peak of the span first (one small programme: the common case), then, when
    that does not fit, the relaxation over every moment (what it refuses, whole replicas
    refuse too) and whole replicas moment by moment."""
    programme = fleet.programme
    slack = tolerance(float(sold.demand.sum(axis=1).max(initial=0.0)) + mu_per_minute)
    if sold.demand.shape[0] > 1:
        peak = sold.demand.max(axis=0, keepdims=True)
        if programme.whole_fits(peak, model_id, mu_per_minute - slack):
            return True
    kept = sold.demand[_kept(sold.demand)]
    relaxed = programme.available(kept, model_id)
    if relaxed.mu_per_minute is None or relaxed.mu_per_minute < mu_per_minute - slack:
        return False
    whole = programme.whole_fits(kept, model_id, mu_per_minute - slack, hint=relaxed.moment_index)
    if whole is None:
        logger.warning(
            "whole replicas undecided in %s s for a sale of %s MU/min of %s (%d moments): "
            "the relaxation's answer (fits)",
            WHOLE_REPLICAS_SECONDS,
            mu_per_minute,
            fleet.model_names.get(model_id, model_id),
            kept.shape[0],
        )
        return True
    return whole


@dataclass(frozen=True)
class JointCapacity:
    sellable_mu_per_minute: float
    available_mu_per_minute: float


def _servable(fleet: JointFleet, demand: np.ndarray, model_id: int) -> np.ndarray:
    """The others' sales cut to what the fleet can serve of them, so that what remains for
    `model_id` is still defined when they are oversold."""
    others = demand.copy()
    others[:, fleet.programme.model_index[model_id]] = 0.0
    return demand - fleet.programme.shortfall(others).per_model


def joint_capacity(
    model_ids: Iterable[int], *, now: datetime | None = None
) -> dict[int, JointCapacity]:
    """Per model: what it could have sold now given the others' sales now, and what an
    open-ended sale from now could still take (never below 0), in whole replicas. Each group
    of models that share pools is read once. The figures of all the models share one
    WHOLE_REPLICAS_SECONDS (the tick records them every minute): those left when it has run
    out are the relaxation's."""
    now = now or timezone.now()
    wanted = set(model_ids)
    group_ids = models_sharing_pools(wanted)
    edges = deployment_edges()
    result: dict[int, JointCapacity] = {}
    deadline = time.monotonic() + WHOLE_REPLICAS_SECONDS
    relaxed_only = []

    def left() -> float:
        return deadline - time.monotonic()

    for group in components(edges, group_ids):
        if not group & wanted:
            continue
        fleet = joint_fleet(group, now=now)
        sold = sold_moments(fleet, start=now)
        for model_id in sorted(group & wanted):
            if left() <= 0:
                relaxed_only.append(fleet.model_names[model_id])
            column = fleet.programme.model_index[model_id]
            now_demand = sold.demand[:1]
            at_now = whole_available(fleet, now_demand, model_id, seconds=left())
            if at_now.mu_per_minute is None:
                at_now = whole_available(
                    fleet, _servable(fleet, now_demand, model_id), model_id, seconds=left()
                )
            horizon = available_for(fleet, sold, model_id, seconds=left())
            if horizon.mu_per_minute is None:
                kept = sold.demand[_kept(sold.demand)]
                horizon = whole_available(
                    fleet, _servable(fleet, kept, model_id), model_id, seconds=left()
                )
            result[model_id] = JointCapacity(
                sellable_mu_per_minute=max(
                    0.0, float(now_demand[0, column]) + (at_now.mu_per_minute or 0.0)
                ),
                available_mu_per_minute=max(0.0, horizon.mu_per_minute or 0.0),
            )
    if relaxed_only:
        logger.warning(
            "sellable figures of %d model(s) are the relaxation's (split replicas): whole "
            "replicas took over %s s for the others (%s)",
            len(relaxed_only),
            WHOLE_REPLICAS_SECONDS,
            ", ".join(relaxed_only[:10]),
        )
    return result
