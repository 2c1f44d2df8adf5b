"""How much of a model the fleet can deploy and sell, in the model's MU per minute (DESIGN §1).

A replica of the model's reference GPU type mints R = 100 MU/min by definition. A replica of
another deployment mints R · t_ref(w) / t_dep(w), with t the replica-seconds its cost model
predicts for the workload mix w (the mean request of the last hour, or a default mix).

Pools are shared: a model's deployments in one pool compete for its GPUs, so each pool's GPUs
go to the model's deployments there best MU per GPU first, each up to its max replicas.
Other models' claims on a pool are not subtracted: planners cover them with headroom and
overcommit, which are set per model.
"""

from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Sum
from django.utils import timezone

from capacity.models import CostModel, Deployment, ServedModel, UsageMinute
from capacity.pricing.cost_models import active_cost_model
from capacity.pricing.exchange import DEFAULT_MIX, MeanShape
from capacity.pricing.exchange import replica_mu_per_minute as exchange_rate

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
    sellable_mu_per_minute: float
    headroom: float
    overcommit: float
    mix: MeanShape
    reference_cost_model_id: int | None
    deployments: list[DeploymentCapacity] = field(default_factory=list)


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
    *, deployment: Deployment, reference: CostModel, mix: MeanShape
) -> tuple[float | None, str]:
    """MU/min one replica of the deployment mints, and why when it cannot be known."""
    gpu_type = deployment.gpu_pool.gpu_type
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


def model_capacity(served_model: ServedModel, *, now=None) -> ModelCapacity:
    reference = active_cost_model(served_model=served_model)
    mix = workload_mix(served_model, now=now)
    deployments = list(
        Deployment.objects.filter(served_model=served_model).select_related(
            "gpu_pool__gpu_type", "served_model"
        )
    )
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
                deployment=deployment, reference=reference, mix=mix
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
        sellable_mu_per_minute=deployable * (1 - served_model.headroom) * served_model.overcommit,
        headroom=served_model.headroom,
        overcommit=served_model.overcommit,
        mix=mix,
        reference_cost_model_id=reference.pk if reference else None,
        deployments=sorted(results, key=lambda d: d.name),
    )
