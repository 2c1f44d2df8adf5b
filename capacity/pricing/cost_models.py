"""Reads of versioned cost models (docs/design.md#versions): the active version of a model on a
GPU type, the version estimates and predictions price with, every active version by shape.
Recording, reviewing and activating versions is capacity.repricing's.
"""

from django.db.models import QuerySet

from capacity.models import CostModel, GpuType, ServedModel
from core.errors import DomainError

FEATURE_FOR_ALPHA = "input_tokens"
FEATURE_FOR_BETA = "output_tokens"
FEATURE_FOR_GAMMA = "request"


def active_version_of_group(cost_model: CostModel) -> CostModel | None:
    """The active version of the same model, GPU type and size (None when none is, or when
    this is it)."""
    return (
        CostModel.objects.filter(
            served_model_id=cost_model.served_model_id,
            gpu_type_id=cost_model.gpu_type_id,
            gpus_per_replica=cost_model.gpus_per_replica,
            status=CostModel.Status.ACTIVE,
        )
        .exclude(pk=cost_model.pk)
        .first()
    )


def cost_models() -> QuerySet[CostModel]:
    """Every cost model version, with its model, GPU type and source run (one query)."""
    return CostModel.objects.select_related("served_model", "gpu_type", "source_link")


def active_cost_models_by_shape(*, served_model_ids=None) -> dict[tuple[int, int, int], CostModel]:
    """Every active version as (model id, GPU type id, GPUs per replica) -> version, with only
    what pricing and the exchange rate read: the fit records (candidates, residuals, the price
    review) are large JSON documents. `served_model_ids`: only those models' (None: all)."""
    queryset = CostModel.objects.filter(status=CostModel.Status.ACTIVE)
    if served_model_ids is not None:
        queryset = queryset.filter(served_model_id__in=served_model_ids)
    return {
        (c.served_model_id, c.gpu_type_id, c.gpus_per_replica): c
        for c in queryset.only(
            "pk",
            "served_model_id",
            "gpu_type_id",
            "gpus_per_replica",
            "weights_replica_seconds",
            "replica_mu_per_minute",
        )
    }


def active_cost_model(
    *,
    served_model: ServedModel,
    gpu_type: GpuType | None = None,
    gpus_per_replica: int | None = None,
) -> CostModel | None:
    """The active version for a model on a GPU type (default: the model's reference GPU)."""
    queryset = cost_models().filter(
        served_model=served_model,
        gpu_type=gpu_type or served_model.reference_gpu_type,
        status=CostModel.Status.ACTIVE,
    )
    if gpus_per_replica is not None:
        queryset = queryset.filter(gpus_per_replica=gpus_per_replica)
    return queryset.order_by("gpus_per_replica").first()


def pricing_cost_model(*, served_model: ServedModel, gpu_type: GpuType | None = None) -> CostModel:
    """The active version, else the newest candidate: what estimates and predictions use."""
    active = active_cost_model(served_model=served_model, gpu_type=gpu_type)
    if active is not None:
        return active
    candidate = (
        cost_models()
        .filter(
            served_model=served_model,
            gpu_type=gpu_type or served_model.reference_gpu_type,
            status=CostModel.Status.CANDIDATE,
        )
        .order_by("-version")
        .first()
    )
    if candidate is None:
        gpu_name = (gpu_type or served_model.reference_gpu_type).name
        raise DomainError(
            f"No cost model for '{served_model.name}' on {gpu_name} yet: import or run a "
            "benchmark and fit one.",
            field="model",
            code="no_cost_model",
            status=409,
        )
    return candidate
