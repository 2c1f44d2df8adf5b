"""Writes for the fleet catalog.

Placing a deployment reads its pool's size and writes against it, so the pool row is locked
(`select_for_update`) for the check: a pool cannot shrink under a deployment being created.
A deployment's suite and nightly-benchmark beat row are benchmarking's (it sits above
capacity): a deployment's write announces itself through capacity.hooks, and benchmarking
writes them in the same transaction.

A write that changes what the fleet can serve (a pool's GPUs, a deployment's size, pool,
model or existence, a model's headroom, overcommit or reference GPU type) runs inside
`capacity_change` (capacity.selling.at_risk): refused with 409 naming the reservations at
risk when it leaves sold capacity unserved, unless forced with a reason.
"""

from contextlib import nullcontext

from django.db import transaction

from capacity.actuation.config import validate_actuator_config
from capacity.catalog.engine_profile import validate_engine_profile
from capacity.hooks import deployment_deleted, deployment_written, gateway_state_changed
from capacity.models import Deployment, GpuPool, GpuType, ServedModel
from capacity.selling.at_risk import capacity_change
from capacity.telemetry.prometheus import validate_selector
from core import outbound
from core.audit import all_fields, audit_change, audit_record, snapshot
from core.errors import ConflictError, DomainError

# What a deployment's writer may set, in the order forms and the API show it; the one list the
# API serializer and the admin form are built from.
DEPLOYMENT_FIELDS = (
    "name",
    "served_model",
    "gpu_pool",
    "gpus_per_replica",
    "min_replicas",
    "max_replicas",
    "current_replicas",
    "cold_start_seconds",
    "scale_to_zero_after_seconds",
    "target_utilisation",
    "endpoint_url",
    "actuator_kind",
    "actuator_config",
    "prometheus_selector",
    "benchmark_suite",
    "benchmark_nightly",
    "benchmark_hour_utc",
    "priority_scheduling",
    "engine_profile",
)
# What a served model's writer may set; the one list the API serializer and the admin form
# are built from.
SERVED_MODEL_FIELDS = (
    "name",
    "engine_model_id",
    "parameters_billions",
    "reference_gpu_type",
    "context_length_tokens",
    "headroom",
    "overcommit",
    "best_effort_ceiling_mu_per_minute",
    "best_effort_ceiling_replicas",
    # Rule 3c of capacity.allocation.policy (the forecast and the SLO correction), per model.
    "prediction_enabled",
)


def check_fits_pool(*, pool: GpuPool, max_replicas: int, gpus_per_replica: int) -> None:
    """Refuse (DomainError on max_replicas) a deployment whose largest size needs more GPUs than its
    pool has."""
    needed_gpus = max_replicas * gpus_per_replica
    if needed_gpus > pool.gpu_count:
        raise DomainError(
            f"max_replicas {max_replicas} × gpus_per_replica {gpus_per_replica} = {needed_gpus} "
            f"GPUs exceeds pool '{pool.name}', which has {pool.gpu_count} GPUs.",
            field="max_replicas",
            code="exceeds_pool",
            details={
                "max_replicas": max_replicas,
                "gpus_per_replica": gpus_per_replica,
                "needed_gpus": needed_gpus,
                "pool": pool.name,
                "pool_gpu_count": pool.gpu_count,
            },
        )


def _check_shape(values: dict) -> None:
    if values["gpus_per_replica"] < 1:
        raise DomainError("gpus_per_replica must be at least 1.", field="gpus_per_replica")
    if values["min_replicas"] > values["max_replicas"]:
        raise DomainError(
            f"max_replicas ({values['max_replicas']}) must be at least min_replicas "
            f"({values['min_replicas']}).",
            field="max_replicas",
        )
    if not 0 < values["target_utilisation"] <= 1:
        raise DomainError("target_utilisation must be in (0, 1].", field="target_utilisation")
    if values.get("prometheus_selector"):
        # Stored normalised; a malformed one is refused here rather than at every tick.
        values["prometheus_selector"] = validate_selector(values["prometheus_selector"])
    values["engine_profile"] = validate_engine_profile(values.get("engine_profile"))


# What the nightly benchmark is made of: a write that changes one is checked (and, with the
# name, re-syncs the beat row: benchmarking.schedules).
NIGHTLY_FIELDS = frozenset({"benchmark_suite", "benchmark_nightly", "benchmark_hour_utc"})


def check_nightly(values: dict) -> None:
    """A nightly benchmark runs the deployment's suite: without one, ticking the flag would
    schedule a run that does nothing, every night."""
    if values.get("benchmark_nightly") and values.get("benchmark_suite") is None:
        raise DomainError(
            "benchmark_nightly needs a benchmark_suite: the nightly run measures that suite.",
            field="benchmark_nightly",
        )
    hour = values.get("benchmark_hour_utc")
    if hour is not None and not 0 <= hour <= 23:
        raise DomainError(
            f"benchmark_hour_utc must be an hour of the day, 0 to 23 (UTC); got {hour}.",
            field="benchmark_hour_utc",
        )


def _check_endpoint(url: str | None) -> None:
    # Health probes connect to it (OUTBOUND_ALLOWED_HOSTS); benchmark runs check it again
    # against BENCHMARK_ALLOWED_HOSTS when they are queued.
    if url:
        outbound.check_url(url, purpose=outbound.OUTBOUND, field="endpoint_url")


def _check_current(values: dict) -> None:
    """A writer that states current_replicas states what runs, and no more than max_replicas
    can run. (Lowering max_replicas below what runs is fine: the next tick scales down.)"""
    if values["current_replicas"] > values["max_replicas"]:
        raise DomainError(
            f"current_replicas ({values['current_replicas']}) must not exceed max_replicas "
            f"({values['max_replicas']}).",
            field="current_replicas",
        )


@transaction.atomic
def deployment_create(**values) -> Deployment:
    """Create a deployment from the values its writer may set (DEPLOYMENT_FIELDS), audited, with its
    nightly beat row in the same transaction; gateways see it after the commit."""
    unknown = set(values) - set(DEPLOYMENT_FIELDS)
    if unknown:
        raise DomainError(f"Unknown deployment fields: {', '.join(sorted(unknown))}.")
    defaults = {
        field.name: field.get_default()
        for field in Deployment._meta.concrete_fields
        if field.name in DEPLOYMENT_FIELDS and field.name not in values and field.has_default()
    }
    values = defaults | values
    _check_shape(values)
    _check_current(values)
    check_nightly(values)
    _check_fits_its_pool(values)
    values["actuator_config"] = validate_actuator_config(
        values["actuator_kind"], values.get("actuator_config")
    )
    _check_endpoint(values.get("endpoint_url"))
    # The suite is benchmarking's reference to the deployment, written by its subscriber.
    deployment = Deployment.objects.create(
        **{name: value for name, value in values.items() if name != "benchmark_suite"}
    )
    deployment_written(deployment, values)
    _audit_created("deployment", deployment)
    gateway_state_changed("deployment created")
    return deployment


def _check_fits_its_pool(values: dict) -> None:
    """Under the pool's row lock: a pool cannot shrink under a deployment being placed."""
    pool = GpuPool.objects.select_for_update().get(pk=values["gpu_pool"].pk)
    check_fits_pool(
        pool=pool,
        max_replicas=values["max_replicas"],
        gpus_per_replica=values["gpus_per_replica"],
    )


# What a deployment can serve: a change to one re-checks what is sold.
CAPACITY_FIELDS = frozenset({"served_model", "gpu_pool", "gpus_per_replica", "max_replicas"})
MODEL_CAPACITY_FIELDS = frozenset({"headroom", "overcommit", "reference_gpu_type"})


def _guard(action: str, *, changed: bool, force: bool, force_reason: str, obj, **touched):
    if not changed:
        return nullcontext()
    return capacity_change(action=action, force=force, reason=force_reason, obj=obj, **touched)


@transaction.atomic
def deployment_update(
    *, deployment: Deployment, force: bool = False, force_reason: str = "", **changes
) -> Deployment:
    """`force` with a `force_reason`: go ahead even when sold capacity would be at risk."""
    unknown = set(changes) - set(DEPLOYMENT_FIELDS)
    if unknown:
        raise DomainError(f"Unknown deployment fields: {', '.join(sorted(unknown))}.")
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    before = catalog_audit_state(deployment)
    values = {name: getattr(deployment, name) for name in DEPLOYMENT_FIELDS} | changes
    _check_shape(values)
    if changes.get("current_replicas", deployment.current_replicas) != deployment.current_replicas:
        _check_current(values)
    if NIGHTLY_FIELDS & set(changes):
        check_nightly(values)
    _check_fits_its_pool(values)
    if "actuator_kind" in changes or "actuator_config" in changes:
        values["actuator_config"] = validate_actuator_config(
            values["actuator_kind"], values.get("actuator_config")
        )
        # A valid config is written: whatever was flagged in the stored one is gone.
        deployment.actuator_config_problem = ""
    if "endpoint_url" in changes:
        _check_endpoint(values.get("endpoint_url"))
    changed = any(before.get(f"{name}_id", before.get(name)) != _pk(values[name])
                  for name in CAPACITY_FIELDS)  # fmt: skip
    guard = _guard(
        "deployment.update",
        changed=changed,
        force=force,
        force_reason=force_reason,
        obj=deployment,
        model_ids=[deployment.served_model_id, _pk(values["served_model"])],
        pool_ids=[deployment.gpu_pool_id, _pk(values["gpu_pool"])],
    )
    with guard:
        for name, value in values.items():
            if name != "benchmark_suite":  # benchmarking's, written by its subscriber
                setattr(deployment, name, value)
        deployment.save()
    deployment_written(deployment, changes)
    _audit_updated("deployment", deployment, before)
    gateway_state_changed("deployment changed")  # e.g. priority_scheduling, a new pool's GPU
    return deployment


@transaction.atomic
def gpu_pool_create(*, name: str, gpu_type: GpuType, gpu_count: int) -> GpuPool:
    """Create a GPU pool, audited."""
    if GpuPool.objects.filter(name=name).exists():
        raise ConflictError(f"A GPU pool named '{name}' already exists.", field="name")
    pool = GpuPool.objects.create(name=name, gpu_type=gpu_type, gpu_count=gpu_count)
    _audit_created("gpu_pool", pool)
    return pool


def _pk(value):
    return getattr(value, "pk", value)


@transaction.atomic
def gpu_pool_update(
    *, pool: GpuPool, force: bool = False, force_reason: str = "", **changes
) -> GpuPool:
    """Change a GPU pool, audited; shrinking it is checked against what is sold
    (capacity.selling.at_risk)."""
    pool = GpuPool.objects.select_for_update().get(pk=pool.pk)
    before = snapshot(pool, all_fields(pool))
    type_changes = "gpu_type" in changes and changes["gpu_type"].pk != pool.gpu_type_id
    if type_changes and pool.deployments.exists():
        raise ConflictError(
            "The GPU type of a pool with deployments cannot change: the deployments' "
            "capacity was measured on the old type.",
            field="gpu_type",
        )
    new_count = changes.get("gpu_count", pool.gpu_count)
    largest = max(pool.deployments.all(), key=lambda deployment: deployment.max_gpus, default=None)
    if largest is not None and largest.max_gpus > new_count:
        raise ConflictError(
            f"gpu_count {new_count} is below what deployment '{largest.name}' may use: "
            f"max_replicas {largest.max_replicas} × gpus_per_replica "
            f"{largest.gpus_per_replica} = {largest.max_gpus} GPUs.",
            field="gpu_count",
            details={"deployment": largest.name, "needed_gpus": largest.max_gpus},
        )
    guard = _guard(
        "gpu_pool.update",
        changed=new_count != pool.gpu_count,
        force=force,
        force_reason=force_reason,
        obj=pool,
        pool_ids=[pool.pk],
    )
    with guard:
        for name, value in changes.items():
            setattr(pool, name, value)
        pool.save()
    _audit_updated("gpu_pool", pool, before)
    return pool


def _create_named(model, label: str, values: dict):
    """A catalog row whose name is its key: a clear 409 for a taken name, then audited."""
    if model.objects.filter(name=values["name"]).exists():
        raise ConflictError(f"A {label} named '{values['name']}' already exists.", field="name")
    instance = model.objects.create(**values)
    _audit_created(_AUDIT_NAMES[model], instance)
    return instance


@transaction.atomic
def gpu_type_create(**values) -> GpuType:
    """Create a GPU type, audited."""
    return _create_named(GpuType, "GPU type", values)


@transaction.atomic
def served_model_create(**values) -> ServedModel:
    """Create a served model, audited; gateways see it after the commit."""
    served_model = _create_named(ServedModel, "model", values)
    gateway_state_changed("model created")
    return served_model


@transaction.atomic
def catalog_update(*, instance, force: bool = False, force_reason: str = "", **changes):
    """GPU types and served models: a plain update, re-checking what is sold when a model's
    headroom, overcommit or reference GPU type changes."""
    before = snapshot(instance, all_fields(instance))
    changed = isinstance(instance, ServedModel) and any(
        before.get(f"{name}_id", before.get(name))
        != _pk(changes.get(name, getattr(instance, name)))
        for name in MODEL_CAPACITY_FIELDS
    )
    guard = _guard(
        "served_model.update",
        changed=changed,
        force=force,
        force_reason=force_reason,
        obj=instance,
        model_ids=[instance.pk],
    )
    with guard:
        for name, value in changes.items():
            setattr(instance, name, value)
        instance.save()
    _audit_updated(_AUDIT_NAMES[type(instance)], instance, before)
    gateway_state_changed("catalog changed")  # model names, engine ids, GPU type names
    return instance


@transaction.atomic
def catalog_delete(*, instance, force: bool = False, force_reason: str = "") -> None:
    """Delete a catalogue row; one still in use is refused by its protected relations, and a
    deployment whose capacity is sold by the at-risk check."""
    before = catalog_audit_state(instance)
    label = str(instance)
    pk = instance.pk
    is_deployment = isinstance(instance, Deployment)
    guard = _guard(
        "deployment.delete",
        changed=is_deployment,
        force=force,
        force_reason=force_reason,
        obj=instance,
        model_ids=[instance.served_model_id] if is_deployment else [],
        pool_ids=[instance.gpu_pool_id] if is_deployment else [],
    )
    with guard:
        instance.delete()
    if isinstance(instance, Deployment):
        deployment_deleted(pk)
    audit_record(
        action=f"{_AUDIT_NAMES[type(instance)]}.delete",
        object_type=instance._meta.label_lower,
        object_id=pk,
        object_repr=label,
        before=before,
    )
    gateway_state_changed("catalog changed")


_AUDIT_NAMES = {
    GpuType: "gpu_type",
    GpuPool: "gpu_pool",
    ServedModel: "served_model",
    Deployment: "deployment",
}


def catalog_audit_state(obj) -> dict:
    """What the audit log keeps of a catalogue row: its fields, and a deployment's suite (by
    id, as a foreign key is kept), which benchmarking holds."""
    state = snapshot(obj, all_fields(obj))
    if isinstance(obj, Deployment):
        suite = obj.benchmark_suite
        state["benchmark_suite"] = None if suite is None else suite.pk
    return state


def _audit_created(name: str, obj) -> None:
    audit_record(action=f"{name}.create", obj=obj, after=catalog_audit_state(obj))


def _audit_updated(name: str, obj, before: dict) -> None:
    audit_change(action=f"{name}.update", obj=obj, before=before, after=catalog_audit_state(obj))
