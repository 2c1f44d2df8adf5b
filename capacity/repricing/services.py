"""Repricing: recording, reviewing and activating versions of a cost model
(docs/design.md#versions).

A new fit is recorded as the next version. It becomes active at once, retiring the previous
active version, only when its cross-validated error is under COST_MODEL_MAX_ACTIVE_MAPE_PERCENT
(default 10 %) *and* the price review allows it (capacity.pricing.review, the rule's one
home): priced on the model's last week of real request shapes, it changes the total, and each
sizeable customer's charge, by at most COST_MODEL_MAX_AUTO_CHANGE_PERCENT (default 5 %) from
the active version and from the review's baseline (the last version a planner approved or the
one in force 30 days ago, whichever is more recent), so small steps cannot add up unreviewed.
Otherwise it waits, as a candidate with the reason and the review stored on it, for a planner
to activate or reject it. Every activation records who approved it (a user, a key, or
"system:auto" and why), on the version and in the audit log; a planner's approval is what
resets the baseline.

The (model, GPU type, GPUs per replica) row of the served model is locked while versions
change, and a partial unique constraint keeps a single active version even if that lock were
bypassed.

Activating or retiring a version changes what the model's replicas mint (a re-fit can lower a
non-reference GPU type's exchange rate), so both run inside the at-risk check of
capacity.selling.at_risk: refused with 409 naming the reservations at risk when sold capacity
would go unserved, unless forced with a reason. An automatic activation that would be
refused waits for a planner instead. This room sits above selling (capacity's layers,
pyproject.toml): selling prices with the cost models' reads (capacity.pricing.cost_models),
and these writes check what selling sold.
"""

from collections.abc import Mapping, Sequence

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from capacity.hooks import gateway_state_changed
from capacity.models import CostModel, GpuType, ServedModel
from capacity.pricing.cost_models import (
    FEATURE_FOR_ALPHA,
    FEATURE_FOR_BETA,
    FEATURE_FOR_GAMMA,
    active_version_of_group,
)
from capacity.pricing.features import REPLICA_MU_PER_MINUTE
from capacity.pricing.review import (
    AutoActivationReview,
    PriceChange,
    auto_activation_review,
    price_change,
)
from capacity.selling.at_risk import capacity_change
from capacity.selling.sellable import lock_models_sharing_pools
from core.audit import audit_record, current_actor
from core.errors import ConflictError

AUTO = "system:auto"

HELD = "Waits for a planner: {reason}."
REVIEW_REASON_CHARS = CostModel._meta.get_field("review_reason").max_length
# What the price review's reason may take of review_reason once HELD wraps it.
HELD_REASON_CHARS = REVIEW_REASON_CHARS - len(HELD.format(reason=""))


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
    cv_error_by_feature: Mapping[str, Mapping[str, float | int]] | None = None,
    replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE,
    auto_activate: bool = True,
    held_because: str = "",
) -> CostModel:
    """A new version; with `auto_activate` it activates when accurate and close enough to the
    active one, unless `held_because` says why it must wait for a planner whatever its fit."""
    # Serialise version numbering per served model (with every model sharing its pools: the
    # activation below locks those, and locks are taken in one order).
    _lock_group(served_model.pk)
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
        cv_error_by_feature={name: dict(v) for name, v in (cv_error_by_feature or {}).items()},
        candidates=candidates,
        residuals=residuals,
    )
    if auto_activate:
        cost_model = _activate_or_hold(cost_model, held_because=held_because)
    return cost_model


def _activate_or_hold(cost_model: CostModel, *, held_because: str = "") -> CostModel:
    """Activate a new fit when it is accurate enough and the price review lets it; else keep
    it a candidate with the reason, for a planner."""
    max_mape = settings.COST_MODEL_MAX_ACTIVE_MAPE
    mape = (
        f"cross-validated MAPE {cost_model.cv_mape * 100:.1f} % is "
        f"{'within' if cost_model.cv_mape <= max_mape else 'above'} "
        f"COST_MODEL_MAX_ACTIVE_MAPE_PERCENT ({max_mape * 100:g} %)"
    )
    current = active_version_of_group(cost_model)
    review = auto_activation_review(candidate=cost_model, active=current) if current else None
    if review is not None:
        cost_model.price_change = review.summary()
        cost_model.save(update_fields=["price_change"])
    if held_because:
        return _hold(cost_model, reason=held_because, review=review)
    if cost_model.cv_mape > max_mape:
        return _hold(cost_model, reason=mape, review=review)
    if review is None:
        return _activate_unless_at_risk(
            cost_model,
            reason=f"{mape}; no version was active, so it reprices nothing that was priced",
        )
    if review.holds:
        return _hold(cost_model, reason=review.describe(max_chars=HELD_REASON_CHARS), review=review)
    return _activate_unless_at_risk(cost_model, reason=f"{mape}; {review.describe()}")


def _activate_unless_at_risk(cost_model: CostModel, *, reason: str) -> CostModel:
    """Activate automatically, or hold it for a planner when it would put sold capacity at
    risk (a planner may force it)."""
    try:
        return cost_model_activate(cost_model=cost_model, actor=AUTO, reason=reason)
    except ConflictError as error:
        if error.code != "capacity_at_risk":
            raise
        cost_model.refresh_from_db()
        return _hold(cost_model, reason=error.message, review=None)


def _lock_group(served_model_id: int) -> None:
    lock_models_sharing_pools([served_model_id])


def _capacity_change(cost_model: CostModel, action: str, *, force: bool, reason: str):
    return capacity_change(
        action=action,
        model_ids=[cost_model.served_model_id],
        force=force,
        reason=reason,
        obj=cost_model,
    )


def _hold(cost_model: CostModel, *, reason: str, review: AutoActivationReview | None) -> CostModel:
    cost_model.review_reason = HELD.format(reason=reason)[:REVIEW_REASON_CHARS]
    cost_model.save(update_fields=["review_reason"])
    audit_record(
        actor=AUTO,
        action="cost_model.hold",
        obj=cost_model,
        after={"status": cost_model.status, "cv_mape": cost_model.cv_mape}
        | (review.audit() if review is not None else {}),
        reason=cost_model.review_reason,
    )
    return cost_model


def cost_model_price_change(*, cost_model: CostModel) -> PriceChange | None:
    """What activating this version would do to prices now, against the active version of its
    group; None when it is the active one or none is active."""
    current = active_version_of_group(cost_model)
    if current is None or cost_model.status == CostModel.Status.ACTIVE:
        return None
    return price_change(candidate=cost_model, current=current)


@transaction.atomic
def cost_model_activate(
    *, cost_model: CostModel, actor: str | None = None, reason: str = "", force: bool = False
) -> CostModel:
    """Put a version in force, retiring the active one; `actor` approved it (default: whoever
    the current request or job is) for `reason`. The price change it makes at this moment is
    written to the audit entry with them. `force`: even when sold capacity would be at risk
    (`reason` says why)."""
    _lock_group(cost_model.served_model_id)
    if CostModel.objects.filter(pk=cost_model.pk, status=CostModel.Status.ACTIVE).exists():
        return CostModel.objects.get(pk=cost_model.pk)
    with _capacity_change(cost_model, "cost_model.activate", force=force, reason=reason):
        return _activate(cost_model, actor=actor, reason=reason)


def _activate(cost_model: CostModel, *, actor: str | None, reason: str) -> CostModel:
    cost_model = CostModel.objects.select_for_update().get(pk=cost_model.pk)
    actor = actor or current_actor()
    # An automatic activation was just measured by _activate_or_hold; a planner's is measured
    # now, on the traffic of the moment they approved it.
    change = cost_model_price_change(cost_model=cost_model) if actor != AUTO else None
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
    cost_model.approved_by = actor[:200]
    cost_model.approval_reason = reason[:2000]
    cost_model.save(
        update_fields=["status", "activated_at", "retired_at", "approved_by", "approval_reason"]
    )
    after = {"status": cost_model.status, "cv_mape": cost_model.cv_mape, "approved_by": actor}
    if change is not None:
        after |= {"price_change": change.change, "price_change_on": change.describe()}
    audit_record(
        actor=actor,
        action="cost_model.activate",
        obj=cost_model,
        before=before | {"active_versions": [version for _, version in retired]},
        after=after,
        reason=reason,
    )
    gateway_state_changed("cost model activated")  # gateways estimate MU with its weights
    return cost_model


@transaction.atomic
def cost_model_reject(
    *, cost_model: CostModel, actor: str | None = None, reason: str = ""
) -> CostModel:
    """Turn a candidate down after review: it stays on record, never activates itself, and a
    planner may still activate it later."""
    cost_model = CostModel.objects.select_for_update().get(pk=cost_model.pk)
    if cost_model.status != CostModel.Status.CANDIDATE:
        raise ConflictError(
            f"Version {cost_model.version} is {cost_model.status}; only a candidate is rejected"
            + (" (retire an active version instead)." if cost_model.status == "active" else "."),
            field="status",
        )
    actor = actor or current_actor()
    change = cost_model_price_change(cost_model=cost_model)
    cost_model.status = CostModel.Status.REJECTED
    cost_model.rejected_at = timezone.now()
    cost_model.rejected_by = actor[:200]
    cost_model.rejection_reason = reason[:2000]
    cost_model.save(update_fields=["status", "rejected_at", "rejected_by", "rejection_reason"])
    after = {"status": cost_model.status, "rejected_by": actor}
    if change is not None:
        after |= {"price_change": change.change, "price_change_on": change.describe()}
    audit_record(
        actor=actor,
        action="cost_model.reject",
        obj=cost_model,
        before={"status": CostModel.Status.CANDIDATE},
        after=after,
        reason=reason,
    )
    return cost_model


@transaction.atomic
def cost_model_retire(
    *, cost_model: CostModel, actor: str | None = None, force: bool = False, reason: str = ""
) -> CostModel:
    """Retiring the active version leaves its deployments unpriced: they sell nothing, so it
    is checked against what is sold like any change that shrinks the fleet."""
    _lock_group(cost_model.served_model_id)
    cost_model = CostModel.objects.select_for_update().get(pk=cost_model.pk)
    if cost_model.status == CostModel.Status.RETIRED:
        raise ConflictError(f"Version {cost_model.version} is already retired.", field="status")
    before = {"status": cost_model.status}
    with _capacity_change(cost_model, "cost_model.retire", force=force, reason=reason):
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
    gateway_state_changed("cost model retired")
    return cost_model
