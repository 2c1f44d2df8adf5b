"""Reads of cost models (the currency's versions) for the planner's benchmark pages. The
version that prices a model is `capacity.pricing.cost_models.active_cost_model` /
`pricing_cost_model`."""

from django.db.models import Count, Exists, Max, OuterRef, Q, QuerySet

from capacity.models import CostModel, Deployment, GpuType, ServedModel

GroupKey = tuple[int, int, int]
"""(served model id, GPU type id, GPUs per replica): the versions of one cost model."""


def cost_model_groups() -> QuerySet:
    """One row per (model, GPU type, GPUs per replica) with a version: its names, number of
    versions, latest version and newest version waiting for a planner's review (None when
    none waits), by model and GPU name (values rows, for a paginator)."""
    waiting = Q(status=CostModel.Status.CANDIDATE) & ~Q(review_reason="")
    return (
        CostModel.objects.values(
            "served_model_id",
            "served_model__name",
            "gpu_type_id",
            "gpu_type__name",
            "gpus_per_replica",
        )
        .annotate(
            versions=Count("id"),
            latest_version=Max("version"),
            waiting_version=Max("version", filter=waiting),
        )
        .order_by("served_model__name", "gpu_type__name", "gpus_per_replica")
    )


def active_cost_models_of_groups(keys: list[GroupKey]) -> dict[GroupKey, CostModel]:
    """The active version of each of these groups that has one (one query)."""
    if not keys:
        return {}
    active = {}
    for cost_model in CostModel.objects.filter(
        status=CostModel.Status.ACTIVE,
        served_model_id__in={key[0] for key in keys},
        gpu_type_id__in={key[1] for key in keys},
    ):
        active[
            (cost_model.served_model_id, cost_model.gpu_type_id, cost_model.gpus_per_replica)
        ] = cost_model
    return active


def unfitted_deployment_groups(*, limit: int) -> list[dict]:
    """(model, GPU type, GPUs per replica) of deployments that no cost model version covers,
    with how many deployments each, by model and GPU name: values rows with the keys
    served_model__name, gpu_pool__gpu_type_id, gpu_pool__gpu_type__name, gpus_per_replica and
    deployments."""
    fitted = CostModel.objects.filter(
        served_model_id=OuterRef("served_model_id"),
        gpu_type_id=OuterRef("gpu_pool__gpu_type_id"),
        gpus_per_replica=OuterRef("gpus_per_replica"),
    )
    return list(
        Deployment.objects.filter(~Exists(fitted))
        .values(
            "served_model__name",
            "gpu_pool__gpu_type_id",
            "gpu_pool__gpu_type__name",
            "gpus_per_replica",
        )
        .annotate(deployments=Count("id"))
        .order_by("served_model__name", "gpu_pool__gpu_type__name", "gpus_per_replica")[:limit]
    )


def cost_model_versions(
    *, served_model: ServedModel, gpu_type: GpuType, gpus_per_replica: int
) -> list[CostModel]:
    """Every version of one cost model, oldest first, with the run it was fitted from."""
    return list(
        CostModel.objects.filter(
            served_model=served_model, gpu_type=gpu_type, gpus_per_replica=gpus_per_replica
        )
        .select_related("source_link")
        .order_by("version")
    )


def cost_models_with_model_and_gpu() -> QuerySet[CostModel]:
    """Every cost model version, with its model and GPU type (one query)."""
    return CostModel.objects.select_related("served_model", "gpu_type")


def group_has_active_version(
    *, served_model_id: int, gpu_type_id: int, gpus_per_replica: int
) -> bool:
    """Whether a version of this (model, GPU type, GPUs per replica) is active."""
    return CostModel.objects.filter(
        served_model_id=served_model_id,
        gpu_type_id=gpu_type_id,
        gpus_per_replica=gpus_per_replica,
        status=CostModel.Status.ACTIVE,
    ).exists()


def reference_gpu_has_active_version(served_model: ServedModel) -> bool:
    """Whether a version on the model's reference GPU type (any size) is active: what prices
    its metered usage."""
    return CostModel.objects.filter(
        served_model_id=served_model.pk,
        gpu_type_id=served_model.reference_gpu_type_id,
        status=CostModel.Status.ACTIVE,
    ).exists()
