"""Writes and reads of versioned cost models (DESIGN §1).

A new fit is recorded as the next version; it becomes active at once when its cross-validated
error is under the threshold (COST_MODEL_MAX_ACTIVE_MAPE, default 10 %), retiring the previous
active version; otherwise it waits, as a candidate, for a planner. The (model, GPU type, GPUs
per replica) row of the served model is locked while versions change, and a partial unique
constraint keeps a single active version even if that lock were bypassed.
"""

from collections.abc import Mapping, Sequence

from django.conf import settings
from django.db import transaction
from django.db.models import Max, QuerySet
from django.utils import timezone

from capacity.models import CostModel, GpuType, ServedModel
from capacity.pricing.features import REPLICA_MU_PER_MINUTE
from capacity.publication import publish_after_commit
from controlplane.audit import audit_record
from controlplane.errors import ConflictError, DomainError

FEATURE_FOR_ALPHA = "input_tokens"
FEATURE_FOR_BETA = "output_tokens"
FEATURE_FOR_GAMMA = "request"


@transaction.atomic
def cost_model_record(
    *,
    served_model: ServedModel,
    gpu_type: GpuType,
    gpus_per_replica: int,
    features: Sequence[str],
    weights_replica_seconds: Mapping[str, float],
    mu_per_unit: Mapping[str, float],
    sample_count: int,
    distinct_shapes: int,
    cv_mape: float,
    cv_worst_error: float,
    candidates: list,
    residuals: list,
    replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE,
    source_run=None,
    auto_activate: bool = True,
) -> CostModel:
    # Serialise version numbering per served model.
    ServedModel.objects.select_for_update().get(pk=served_model.pk)
    latest = CostModel.objects.filter(
        served_model=served_model, gpu_type=gpu_type, gpus_per_replica=gpus_per_replica
    ).aggregate(latest=Max("version"))["latest"]
    cost_model = CostModel.objects.create(
        served_model=served_model,
        gpu_type=gpu_type,
        gpus_per_replica=gpus_per_replica,
        version=(latest or 0) + 1,
        features=list(features),
        weights_replica_seconds=dict(weights_replica_seconds),
        replica_mu_per_minute=replica_mu_per_minute,
        alpha_mu_per_input_token=mu_per_unit.get(FEATURE_FOR_ALPHA, 0.0),
        beta_mu_per_output_token=mu_per_unit.get(FEATURE_FOR_BETA, 0.0),
        gamma_mu_per_request=mu_per_unit.get(FEATURE_FOR_GAMMA, 0.0),
        mu_per_unit=dict(mu_per_unit),
        sample_count=sample_count,
        distinct_shapes=distinct_shapes,
        cv_mape=cv_mape,
        cv_worst_error=cv_worst_error,
        candidates=candidates,
        residuals=residuals,
        source_run=source_run,
    )
    if auto_activate and cv_mape <= settings.COST_MODEL_MAX_ACTIVE_MAPE:
        cost_model = cost_model_activate(
            cost_model=cost_model,
            actor="system:auto",
            reason=(
                f"cross-validated MAPE {cv_mape:.1%} is within "
                f"COST_MODEL_MAX_ACTIVE_MAPE_PERCENT ({settings.COST_MODEL_MAX_ACTIVE_MAPE:.0%})"
            ),
        )
    return cost_model


@transaction.atomic
def cost_model_activate(
    *, cost_model: CostModel, actor: str | None = None, reason: str = ""
) -> CostModel:
    ServedModel.objects.select_for_update().get(pk=cost_model.served_model_id)
    cost_model = CostModel.objects.select_for_update().get(pk=cost_model.pk)
    if cost_model.status == CostModel.Status.ACTIVE:
        return cost_model
    now = timezone.now()
    previous = CostModel.objects.filter(
        served_model_id=cost_model.served_model_id,
        gpu_type_id=cost_model.gpu_type_id,
        gpus_per_replica=cost_model.gpus_per_replica,
        status=CostModel.Status.ACTIVE,
    )
    retired = list(previous.values_list("pk", "version"))
    previous.update(status=CostModel.Status.RETIRED, retired_at=now)
    before = {"status": cost_model.status}
    cost_model.status = CostModel.Status.ACTIVE
    cost_model.activated_at = now
    cost_model.retired_at = None
    cost_model.save(update_fields=["status", "activated_at", "retired_at"])
    audit_record(
        actor=actor,
        action="cost_model.activate",
        obj=cost_model,
        before=before | {"active_versions": [version for _, version in retired]},
        after={"status": cost_model.status, "cv_mape": cost_model.cv_mape},
        reason=reason,
    )
    publish_after_commit("cost model activated")  # gateways estimate MU with its weights
    return cost_model


@transaction.atomic
def cost_model_retire(*, cost_model: CostModel, actor: str | None = None) -> CostModel:
    cost_model = CostModel.objects.select_for_update().get(pk=cost_model.pk)
    if cost_model.status == CostModel.Status.RETIRED:
        raise ConflictError(f"Version {cost_model.version} is already retired.", field="status")
    before = {"status": cost_model.status}
    cost_model.status = CostModel.Status.RETIRED
    cost_model.retired_at = timezone.now()
    cost_model.save(update_fields=["status", "retired_at"])
    audit_record(
        actor=actor,
        action="cost_model.retire",
        obj=cost_model,
        before=before,
        after={"status": cost_model.status},
    )
    publish_after_commit("cost model retired")
    return cost_model


def cost_models() -> QuerySet[CostModel]:
    return CostModel.objects.select_related("served_model", "gpu_type", "source_run")


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
