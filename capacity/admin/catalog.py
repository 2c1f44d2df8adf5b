"""The catalogue's admin pages: GPU types, pools, served models and deployments. Each change
is audited and published to gateways; a change that would leave sold capacity unserved is
refused, as the API refuses it."""

from django import forms
from django.contrib import admin
from django.db import transaction

from capacity.actuation.config import validate_actuator_config
from capacity.admin.shared import PublishedAdminMixin
from capacity.catalog.engine_profile import validate_engine_profile
from capacity.catalog.selectors import benchmark_suites
from capacity.catalog.services import (
    CAPACITY_FIELDS,
    DEPLOYMENT_FIELDS,
    MODEL_CAPACITY_FIELDS,
    NIGHTLY_FIELDS,
    SERVED_MODEL_FIELDS,
    catalog_audit_state,
    check_fits_pool,
    check_nightly,
)
from capacity.hooks import deployment_deleted, deployment_written
from capacity.models import Deployment, GpuPool, GpuType, ServedModel
from capacity.selling.at_risk import capacity_change
from capacity.telemetry.prometheus import validate_selector
from core import outbound
from core.audit import AuditedAdminMixin, actor_of
from core.errors import ConflictError, DomainError


class _Undo(Exception):
    pass


class CapacityCheckedForm(forms.ModelForm):
    """The admin refuses, as the API does, an edit that would leave sold capacity unserved
    (capacity.selling.at_risk): the edit is tried in a savepoint, measured and undone. There
    is no force here: force one through the API, with a reason."""

    def capacity_touched(self, original) -> dict | None:
        """The models and pools the edit touches; None when it changes no capacity."""
        return None

    def _changes_any(self, original, field_names) -> bool:
        # Foreign keys compared by their ids: the related rows are not fetched.
        fields = [self._meta.model._meta.get_field(name) for name in field_names]
        return any(
            getattr(self.instance, field.attname) != getattr(original, field.attname)
            for field in fields
        )

    def _post_clean(self):
        super()._post_clean()
        if self.errors or self.instance.pk is None:
            return
        original = type(self.instance).objects.get(pk=self.instance.pk)
        touched = self.capacity_touched(original)
        if touched is None:
            return
        try:
            with transaction.atomic():
                with capacity_change(action="admin.check", **touched):
                    self.instance.save()
                raise _Undo
        except _Undo:
            pass
        except ConflictError as error:
            self.add_error(None, error.message)


class GpuPoolAdminForm(CapacityCheckedForm):
    """A pool's edit, checked against what is sold when it loses GPUs."""

    class Meta:
        model = GpuPool
        fields = ["name", "gpu_type", "gpu_count"]

    def capacity_touched(self, original):
        """The pool, when the edit takes GPUs away from it."""
        if self.instance.gpu_count >= original.gpu_count:
            return None
        return {"pool_ids": [original.pk]}


class ServedModelAdminForm(CapacityCheckedForm):
    """A served model's edit, checked against what is sold when it changes the capacity a
    replica sells (headroom, overcommit, the reference GPU type)."""

    class Meta:
        model = ServedModel
        fields = list(SERVED_MODEL_FIELDS)

    def capacity_touched(self, original):
        """The model, when the edit changes what its replicas sell."""
        if not self._changes_any(original, MODEL_CAPACITY_FIELDS):
            return None
        return {"model_ids": [original.pk]}


class DeploymentAdminForm(CapacityCheckedForm):
    """The admin applies the same rules as the API: the pool fit, the actuator config and the
    engine profile."""

    endpoint_url = forms.URLField(required=False, max_length=500, assume_scheme="https")
    # benchmarking's reference to the deployment (benchmarking.references), not a column.
    benchmark_suite = forms.ModelChoiceField(
        queryset=benchmark_suites(),
        required=False,
        help_text="The suite the nightly benchmark runs (see benchmark_nightly).",
    )

    class Meta:
        model = Deployment
        fields = list(DEPLOYMENT_FIELDS)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.initial.setdefault("benchmark_suite", self.instance.benchmark_suite)

    def capacity_touched(self, original):
        """The models and pools before and after, when the edit moves or resizes the
        deployment."""
        if not self._changes_any(original, CAPACITY_FIELDS):
            return None
        return {
            "model_ids": [original.served_model_id, self.instance.served_model_id],
            "pool_ids": [original.gpu_pool_id, self.instance.gpu_pool_id],
        }

    def clean(self):
        cleaned = super().clean()
        try:
            pool = cleaned.get("gpu_pool")
            if pool and cleaned.get("max_replicas") and cleaned.get("gpus_per_replica"):
                check_fits_pool(
                    pool=pool,
                    max_replicas=cleaned["max_replicas"],
                    gpus_per_replica=cleaned["gpus_per_replica"],
                )
            if cleaned.get("prometheus_selector"):
                cleaned["prometheus_selector"] = validate_selector(cleaned["prometheus_selector"])
            if "engine_profile" in cleaned:
                cleaned["engine_profile"] = validate_engine_profile(cleaned["engine_profile"])
            if cleaned.get("actuator_kind"):
                cleaned["actuator_config"] = validate_actuator_config(
                    cleaned["actuator_kind"], cleaned.get("actuator_config")
                )
                # The config saved is valid: whatever was flagged in the stored one is gone.
                self.instance.actuator_config_problem = ""
            if cleaned.get("endpoint_url") and "endpoint_url" in self.changed_data:
                outbound.check_url(cleaned["endpoint_url"], field="endpoint_url")
            if NIGHTLY_FIELDS & set(self.changed_data):
                check_nightly(cleaned)
        except DomainError as error:
            field = error.field.split(".")[0] if error.field else None
            self.add_error(field if field in self.fields else None, error.message)
        return cleaned


@admin.register(GpuType)
class GpuTypeAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    """GPU types and their hourly cost: audited, published to gateways."""

    list_display = ["name", "memory_gb", "hourly_cost_usd"]
    search_fields = ["name"]


@admin.register(GpuPool)
class GpuPoolAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    """GPU pools: audited, published, and refused when shrinking one leaves sold capacity
    unserved."""

    form = GpuPoolAdminForm
    list_display = ["name", "gpu_type", "gpu_count"]
    list_filter = ["gpu_type"]
    search_fields = ["name", "gpu_type__name"]
    list_select_related = ["gpu_type"]


@admin.register(ServedModel)
class ServedModelAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    """Served models: audited, published, and checked against what is sold."""

    form = ServedModelAdminForm
    list_display = [
        "name",
        "engine_model_id",
        "parameters_billions",
        "reference_gpu_type",
        "context_length_tokens",
        "prediction_enabled",
    ]
    list_filter = ["reference_gpu_type", "prediction_enabled"]
    search_fields = ["name", "engine_model_id"]
    list_select_related = ["reference_gpu_type"]


@admin.register(Deployment)
class DeploymentAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    """Deployments, under the API's rules (DeploymentAdminForm), with their nightly-benchmark
    beat row kept in step; what the loop observes of them is read only."""

    form = DeploymentAdminForm
    list_display = [
        "name",
        "served_model",
        "gpu_pool",
        "gpus_per_replica",
        "min_replicas",
        "current_replicas",
        "max_replicas",
        "actuator_kind",
        "actuator_config_refused",
    ]
    list_filter = ["actuator_kind", "served_model", "gpu_pool"]
    search_fields = ["name", "served_model__name", "gpu_pool__name", "endpoint_url"]
    list_select_related = ["served_model", "gpu_pool"]
    readonly_fields = [
        "actuator_config_problem",
        "observed_ready_replicas",
        "observed_starting_replicas",
        "observed_draining_replicas",
        "observed_spec_replicas",
        "replicas_observed_at",
    ]

    @admin.display(boolean=True, description="config refused")
    def actuator_config_refused(self, deployment: Deployment) -> bool:
        """Whether the stored actuator config was flagged as one the actuator refuses."""
        return bool(deployment.actuator_config_problem)

    def audit_state(self, obj) -> dict:
        """The deployment's fields and its suite, as the services' entries keep them."""
        return catalog_audit_state(obj)

    def saved(self, request, obj, form, change) -> None:
        """The admin saves the model itself; its suite and nightly-benchmark beat row
        (benchmarking's) follow in the same transaction (the admin wraps each save in one),
        announced as the services announce their writes."""
        names = form.changed_data if change else DEPLOYMENT_FIELDS
        deployment_written(
            obj, {name: form.cleaned_data[name] for name in names if name in form.cleaned_data}
        )

    def delete_model(self, request, obj):
        """The admin's delete confirmation cannot be refused: a deletion that puts sold
        capacity at risk goes ahead as forced, recorded in the audit log with who confirmed
        it."""
        pk = obj.pk
        with self._capacity_change(request, [obj]):
            super().delete_model(request, obj)
        deployment_deleted(pk)

    @transaction.atomic
    def delete_queryset(self, request, queryset):
        """The bulk delete, forced and recorded as one deletion is."""
        deployments = list(queryset)
        with self._capacity_change(request, deployments):
            super().delete_queryset(request, queryset)
        for deployment in deployments:
            deployment_deleted(deployment.pk)

    def _capacity_change(self, request, deployments):
        return capacity_change(
            action="deployment.delete",
            model_ids=[d.served_model_id for d in deployments],
            pool_ids=[d.gpu_pool_id for d in deployments],
            force=True,
            reason=f"deleted in the admin by {actor_of(user=request.user)}",
            obj=deployments[0] if len(deployments) == 1 else None,
        )
