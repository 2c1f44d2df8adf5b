"""Reads of the catalogue (GPU types, pools, models, deployments) for the planner's pages."""

from decimal import Decimal
from typing import TypedDict, cast

from django.db.models import F, Model, QuerySet, Sum

from capacity.models import Deployment, GpuPool, GpuType, ServedModel


def gpu_types() -> QuerySet[GpuType]:
    """Every GPU type (the catalogue's list)."""
    return GpuType.objects.all()


def gpu_pools() -> QuerySet[GpuPool]:
    """Every GPU pool, with its GPU type (one query)."""
    return GpuPool.objects.select_related("gpu_type")


def served_models() -> QuerySet[ServedModel]:
    """Every served model, with its reference GPU type (one query)."""
    return ServedModel.objects.select_related("reference_gpu_type")


def deployments() -> QuerySet[Deployment]:
    """Every deployment, with its model, pool, the pool's GPU type and its benchmark suite (one
    query)."""
    return Deployment.objects.select_related(
        "served_model", "gpu_pool", "gpu_pool__gpu_type", "benchmark_suite_link__suite"
    )


def benchmark_suites() -> QuerySet:
    """Every benchmark suite, for the deployment's `benchmark_suite` field (API and admin).
    The suite is benchmarking's, which depends on capacity and not the reverse: it is reached
    through the reference benchmarking keeps to the deployment (benchmarking.references)."""
    link = Deployment._meta.get_field("benchmark_suite_link").related_model
    suite = cast("type[Model]", link._meta.get_field("suite").related_model)
    return suite._default_manager.all()


def served_models_by_name() -> QuerySet[ServedModel]:
    """Served models by name, with their reference GPU type (the planner's lists)."""
    return ServedModel.objects.select_related("reference_gpu_type").order_by("name")


def served_models_with_ids(ids) -> QuerySet[ServedModel]:
    """The served models of these ids."""
    return ServedModel.objects.filter(pk__in=ids)


class GpuPoolUsage(TypedDict):
    """A pool's GPUs held by its deployments' current replicas, and what they cost."""

    pool: GpuPool
    used_gpus: int
    free_gpus: int
    running_cost_usd_per_hour: Decimal
    full_cost_usd_per_hour: Decimal


def gpu_pool_usage_by_name() -> list[GpuPoolUsage]:
    """Every pool, by name, with the GPUs its deployments' current replicas hold and what
    they cost: a plain dict each (one query)."""
    pools = (
        GpuPool.objects.select_related("gpu_type")
        .annotate(
            used_gpus=Sum(F("deployments__current_replicas") * F("deployments__gpus_per_replica"))
        )
        .order_by("name")
    )
    rows = []
    for pool in pools:
        used = min(pool.used_gpus or 0, pool.gpu_count)
        hourly = pool.gpu_type.hourly_cost_usd
        rows.append(
            {
                "pool": pool,
                "used_gpus": used,
                "free_gpus": pool.gpu_count - used,
                "running_cost_usd_per_hour": hourly * used,
                "full_cost_usd_per_hour": hourly * pool.gpu_count,
            }
        )
    return rows


def any_deployments() -> bool:
    """Whether the fleet has any deployment (the planner's empty states)."""
    return Deployment.objects.exists()


def deployments_with_model_and_gpu() -> QuerySet[Deployment]:
    """Every deployment, with its model and its pool's GPU type."""
    return Deployment.objects.select_related("served_model", "gpu_pool__gpu_type")


def deployments_of_group(
    *, served_model: ServedModel, gpu_type: GpuType, gpus_per_replica: int
) -> QuerySet[Deployment]:
    """Deployments of this model on this GPU type and size, by name (with their suite)."""
    return (
        Deployment.objects.filter(
            served_model=served_model,
            gpu_pool__gpu_type=gpu_type,
            gpus_per_replica=gpus_per_replica,
        )
        .select_related("benchmark_suite_link__suite")
        .order_by("name")
    )


def any_deployments_of_group(
    *, served_model: ServedModel, gpu_type: GpuType, gpus_per_replica: int
) -> bool:
    """Whether any deployment runs this model on this GPU type and size."""
    return deployments_of_group(
        served_model=served_model, gpu_type=gpu_type, gpus_per_replica=gpus_per_replica
    ).exists()
