"""What a what-if reads of a served model's own fleet (issue 19, item 6; issue 33).

A planner's what-if of a model starts from what the control plane knows of it, not from the
engine emulator's built-in replica:

- the deployments: every deployment that serves the model (or the one a planner picks), each
  simulated from its own GPU type's active cost model's fitted weights (replica capacity and
  latency, `simulation.engine.profile.profile_from_cost_model`) and the engine parameters
  stored with it (`Deployment.engine_profile`, vLLM's defaults where it says nothing), with its
  own cold start and idle window before scale to zero, its GPUs per replica and their hourly
  price. A deployment whose GPU type has no active cost model cannot be simulated: it is left
  out, and the fleet says why (`skipped`);
- the currency: requests priced by the model's reference cost model, as usage is metered, and
  each replica serving R MU/min on the reference GPU type, R · t_ref / t_own on another (over
  the trace's requests);
- the fleet: each deployment within its max replicas, and all of them within their pools'
  GPUs: a pool shared by several deployments holds their replicas together, counted once
  (`simulation.engine.deployments.DeploymentFleet`). The what-if's counts (its fleet cap, the
  overcommit's) are in replicas of the unit deployment, the cheapest MU's, which the policies
  other than the live one size the fleet in (the live one sizes each deployment);
- the selling: the model's reservations in term now, by customer (`reservations_of`);
- the trace, if asked: the model's own recorded usage of the last N days (`usage_trace_csv`),
  replayed from its usage events: when each request started, its input and output tokens, its
  customer. A refused request never produced output: it is replayed with the mean output of
  the requests of the same window that completed.

Errors are DomainErrors naming the form field (served_model, deployment, trace, usage_days,
duration_minutes).
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Avg, Sum

from capacity.catalog.engine_profile import effective_engine_profile
from capacity.models import CostModel, Deployment, Reservation, ServedModel, UsageEvent
from capacity.pricing.features import replica_seconds_of
from core.errors import DomainError
from simulation.engine.deployments import DeploymentFleet, FleetDeployment
from simulation.engine.profile import (
    ConfigError,
    ModelConfig,
    WorkloadMix,
    profile_from_cost_model,
    saturated_batch,
)
from simulation.engine.traces import TraceRequest

USAGE_DAYS = (1, 31)  # the usage a what-if may replay, in days (inclusive)
DEFAULT_USAGE_DAYS = 7


@dataclass(frozen=True)
class Member:
    deployment: Deployment
    cost_model: CostModel  # the deployment's own: its GPU type, its GPUs per replica


@dataclass(frozen=True)
class Fleet:
    members: tuple[Member, ...]  # the one on the reference GPU type first, then by name
    reference: CostModel  # the model's reference GPU type: what prices requests
    # Deployments left out: (name, why), those without an active cost model.
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def deployment(self) -> Deployment:
        """The first member: the one on the model's reference GPU type, if any."""
        return self.members[0].deployment


def _cost_model_label(cost_model: CostModel) -> str:
    return f"{cost_model.gpu_type.name}×{cost_model.gpus_per_replica} v{cost_model.version}"


def fleet_of(served_model: ServedModel, deployment: Deployment | None = None) -> Fleet:
    """The deployments a what-if of `served_model` simulates (all that have an active cost
    model, or the one picked), with their cost models."""
    active = {
        (c.gpu_type_id, c.gpus_per_replica): c
        for c in CostModel.objects.filter(
            served_model=served_model, status=CostModel.Status.ACTIVE
        ).select_related("gpu_type")
    }
    # As the allocation tick: the reference GPU type, fewest GPUs per replica.
    references = sorted(
        (gpus, c) for (gpu, gpus), c in active.items() if gpu == served_model.reference_gpu_type_id
    )
    if not references:
        raise DomainError(
            f"{served_model.name} has no active cost model on its reference GPU type "
            f"({served_model.reference_gpu_type.name}), so its requests cannot be priced: fit "
            "one (Benchmarks), or paste a replica profile to simulate instead.",
            field="served_model",
        )
    reference = references[0][1]
    deployments = list(
        Deployment.objects.filter(served_model=served_model)
        .select_related("gpu_pool__gpu_type")
        .order_by("name")
    )
    if deployment is not None:
        if deployment.served_model_id != served_model.pk:
            raise DomainError(
                f"deployment {deployment.name} serves {deployment.served_model.name}, not "
                f"{served_model.name}.",
                field="deployment",
            )
        own = active.get((deployment.gpu_pool.gpu_type_id, deployment.gpus_per_replica))
        if own is None:
            raise DomainError(
                f"deployment {deployment.name} runs on {deployment.gpu_pool.gpu_type.name}×"
                f"{deployment.gpus_per_replica}, which has no active cost model: fit one, or "
                "pick another deployment.",
                field="deployment",
            )
        return Fleet((Member(deployment, own),), reference)
    members: list[tuple[bool, str, Member]] = []
    skipped: list[tuple[str, str]] = []
    for d in deployments:
        own = active.get((d.gpu_pool.gpu_type_id, d.gpus_per_replica))
        if own is None:
            skipped.append(
                (
                    d.name,
                    f"runs on {d.gpu_pool.gpu_type.name}×{d.gpus_per_replica}, which has no "
                    "active cost model: fit one (Benchmarks) to simulate it",
                )
            )
            continue
        members.append(
            (d.gpu_pool.gpu_type_id != served_model.reference_gpu_type_id, d.name, Member(d, own))
        )
    if not members:
        raise DomainError(
            f"{served_model.name} has no deployment on a GPU type with an active cost model "
            f"(active: {', '.join(_cost_model_label(c) for c in active.values())}): add one, "
            "or paste a replica profile to simulate instead.",
            field="served_model",
        )
    members.sort(key=lambda row: (row[0], row[1]))
    return Fleet(tuple(member for _, _, member in members), reference, tuple(skipped))


def _replica_seconds(weights: dict, requests: list[TraceRequest]) -> float:
    return sum(
        replica_seconds_of(weights, input_tokens=r.input_tokens, output_tokens=r.output_tokens)
        for r in requests
    )


def _member_settings(
    member: Member,
    reference: CostModel,
    requests: list[TraceRequest],
    mix: WorkloadMix,
    reference_seconds: float,
) -> tuple[ModelConfig, dict[str, Any]]:
    """One deployment's replica (its profile) and what the what-if keeps of it."""
    deployment, cost_model = member.deployment, member.cost_model
    served_model = deployment.served_model
    engine = effective_engine_profile(
        deployment.engine_profile or {}, context_length=served_model.context_length_tokens
    )
    try:
        profile = profile_from_cost_model(
            name=deployment.name,
            weights_replica_seconds=cost_model.weights_replica_seconds,
            mix=mix,
            cold_start_seconds=float(deployment.cold_start_seconds),
            **engine,
        )
    except ConfigError as error:
        raise DomainError(
            f"the cost model {_cost_model_label(cost_model)} of deployment {deployment.name} "
            f"cannot describe a replica: {error}",
            field="deployment",
        ) from None
    reference_mu = reference.replica_mu_per_minute
    if cost_model.pk == reference.pk:
        replica_mu = reference_mu
    else:
        # The exchange rate over the trace's own requests (their mean cost under each).
        own_seconds = _replica_seconds(cost_model.weights_replica_seconds, requests)
        replica_mu = (
            reference_mu * reference_seconds / own_seconds if own_seconds > 0 else reference_mu
        )
    pool = deployment.gpu_pool
    fits = pool.gpu_count // deployment.gpus_per_replica
    summary = {
        "name": deployment.name,
        "deployment": deployment.name,
        "gpu_type": pool.gpu_type.name,
        "gpus_per_replica": deployment.gpus_per_replica,
        "gpu_hourly_cost_usd": float(pool.gpu_type.hourly_cost_usd),
        "pool": pool.name,
        "pool_gpus": pool.gpu_count,
        # Its own limit: its max replicas, and what its pool holds were it alone there.
        "max_replicas": max(1, min(deployment.max_replicas, fits)),
        "deployment_max_replicas": deployment.max_replicas,
        "cold_start_seconds": float(deployment.cold_start_seconds),
        "target_utilisation": deployment.target_utilisation,
        "scale_to_zero_after_seconds": deployment.scale_to_zero_after_seconds,
        "engine_profile": engine,
        "saturated_batch": saturated_batch(
            mix, max_num_seqs=engine["max_num_seqs"], kv_cache_tokens=engine["kv_cache_tokens"]
        ),
        "cost_model": {
            "id": cost_model.pk,
            "label": _cost_model_label(cost_model),
            "cv_mape": cost_model.cv_mape,
        },
        "replica_mu_per_minute": replica_mu,
        "model_config": asdict(profile),
    }
    return profile, summary


def fleet_settings(fleet: Fleet, requests: list[TraceRequest]) -> tuple[dict, dict]:
    """(the unit deployment's replica as ModelConfig fields, what the what-if keeps of the
    fleet) for this trace. The fleet's own keys are those of its unit deployment (the cheapest
    MU's), beside `deployments` (each one's), `pools`, `gpus` (its pools' GPUs, each pool once)
    and `skipped`; `max_replicas` is what the whole fleet holds, in replicas of the unit."""
    mix = WorkloadMix.of([(r.input_tokens, r.output_tokens) for r in requests])
    reference_seconds = _replica_seconds(fleet.reference.weights_replica_seconds, requests)
    profiles, rows = [], []
    for member in fleet.members:
        profile, row = _member_settings(member, fleet.reference, requests, mix, reference_seconds)
        profiles.append(profile)
        rows.append(row)
    pools: dict[str, dict[str, Any]] = {}
    for member, row in zip(fleet.members, rows, strict=True):
        pool = member.deployment.gpu_pool
        entry = pools.setdefault(
            pool.name,
            {
                "name": pool.name,
                "gpu_type": pool.gpu_type.name,
                "gpus": pool.gpu_count,
                "deployments": [],
                "other_models": [],
            },
        )
        entry["deployments"].append(row["name"])
    # Other models' deployments on the same pools: the what-if cannot know what they will use,
    # so it holds none of the pool back for them, and says so.
    served_model = fleet.deployment.served_model
    others = (
        Deployment.objects.filter(gpu_pool__name__in=list(pools))
        .exclude(served_model=served_model)
        .order_by("name")
        .values_list("gpu_pool__name", "name")
    )
    for pool_name, name in others:
        pools[pool_name]["other_models"].append(name)
    engine = engine_fleet({"deployments": rows, "pools": list(pools.values())})
    if len(rows) > 1 and engine.capacity_replicas < 1:
        raise DomainError(
            f"none of {fleet.deployment.served_model.name}'s deployments "
            f"({', '.join(row['name'] for row in rows)}) has room for a replica in its pool: "
            "raise a max replicas or a pool's GPUs, or pick a deployment.",
            field="served_model",
        )
    unit = rows[engine.unit_index]
    reference_mu = fleet.reference.replica_mu_per_minute
    summary = {
        **{key: value for key, value in unit.items() if key not in ("name", "model_config")},
        # The whole fleet, in replicas of the unit: its deployments' max replicas within
        # their pools' GPUs, each pool counted once.
        "max_replicas": max(1, engine.capacity_replicas),
        "reference_cost_model": {
            "id": fleet.reference.pk,
            "label": _cost_model_label(fleet.reference),
            "weights_replica_seconds": dict(fleet.reference.weights_replica_seconds),
            "replica_mu_per_minute": reference_mu,
        },
        "deployments": rows,
        "pools": list(pools.values()),
        "gpus": sum(pool["gpus"] for pool in pools.values()),
        "skipped": [{"deployment": name, "reason": why} for name, why in fleet.skipped],
    }
    return asdict(profiles[engine.unit_index]), summary


def engine_fleet(fleet: dict) -> DeploymentFleet:
    """The simulator's fleet from what a what-if kept of it (`fleet_settings`'s summary)."""
    return DeploymentFleet(
        tuple(
            FleetDeployment(
                name=row["name"],
                model=ModelConfig(**row["model_config"]),
                replica_mu_per_minute=row["replica_mu_per_minute"],
                pool=row["pool"],
                max_replicas=row["deployment_max_replicas"],
                cold_start_seconds=row["cold_start_seconds"],
                gpus_per_replica=row["gpus_per_replica"],
                scale_to_zero_after_seconds=row["scale_to_zero_after_seconds"],
                gpu_hourly_cost_usd=row["gpu_hourly_cost_usd"],
            )
            for row in fleet["deployments"]
        ),
        pool_gpus={pool["name"]: pool["gpus"] for pool in fleet["pools"]},
    )


def reservations_of(served_model: ServedModel, *, now: datetime) -> tuple[dict[str, float], bool]:
    """The model's reservations in term now, MU/min by customer slug, and whether any keeps
    the model warm."""
    in_term = Reservation.objects.active_at(now).filter(served_model=served_model)
    rows = (
        in_term.values("customer__slug")
        .annotate(mu=Sum("mu_per_minute"))
        .order_by("customer__slug")
    )
    keep_warm = in_term.filter(keep_warm=True).exists()
    return {row["customer__slug"]: row["mu"] for row in rows}, keep_warm


def usage_trace_csv(
    served_model: ServedModel,
    *,
    days: int,
    duration_minutes: int,
    max_rows: int,
    now: datetime,
) -> tuple[str, int]:
    """(a per-request trace CSV of the model's usage events, events in it): the first
    `duration_minutes` of its last `days` days; at most `max_rows` events, else a DomainError."""
    since = now - timedelta(days=days)
    events = UsageEvent.objects.filter(
        served_model=served_model, started_at__gte=since, started_at__lt=now
    )
    first = events.order_by("started_at").values_list("started_at", flat=True).first()
    if first is None:
        raise DomainError(
            f"{served_model.name} recorded no usage in the last {days} day{'s' * (days != 1)}: "
            "pick a bundled trace or upload one.",
            field="trace",
        )
    window = events.filter(started_at__lt=first + timedelta(minutes=duration_minutes))
    mean_output = window.filter(outcome="completed").aggregate(mean=Avg("output_tokens"))["mean"]
    refused_output = max(1, round(mean_output or 1))
    rows = list(
        window.order_by("started_at", "id").values_list(
            "started_at", "input_tokens", "output_tokens", "outcome", "customer__slug"
        )[: max_rows + 1]
    )
    if len(rows) > max_rows:
        raise DomainError(
            f"the first {duration_minutes} minutes of {served_model.name}'s usage hold more "
            f"than {max_rows:,} requests: shorten the duration or lower the scale.",
            field="duration_minutes",
        )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["timestamp", "input_tokens", "output_tokens", "client"])
    for started_at, input_tokens, output_tokens, outcome, customer in rows:
        output = refused_output if outcome == "refused" else output_tokens
        seconds = (started_at - first).total_seconds()
        writer.writerow([f"{seconds:.3f}", input_tokens, output, customer])
    return out.getvalue(), len(rows)
