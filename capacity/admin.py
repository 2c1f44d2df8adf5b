from django import forms
from django.contrib import admin
from django.db import transaction

from capacity.actuation.config import validate_actuator_config
from capacity.admission import limits as request_limits
from capacity.catalog.engine_profile import validate_engine_profile
from capacity.catalog.services import (
    DEPLOYMENT_FIELDS,
    NIGHTLY_FIELDS,
    check_fits_pool,
    check_nightly,
)
from capacity.models import (
    ActuatorCircuit,
    AdmissionAllowance,
    AllocationDecision,
    BudgetCap,
    CapacityRisk,
    CapacitySample,
    CostModel,
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    Deployment,
    DeploymentFingerprint,
    Entitlement,
    FallbackAdmission,
    GpuPool,
    GpuType,
    Incident,
    IncidentStep,
    ProbeResult,
    Replica,
    RequestLimit,
    Reservation,
    ReservationChange,
    ServedModel,
    TickHeartbeat,
    UsageEvent,
    UsageKeyMinute,
    UsageMinute,
)
from capacity.publication import publish_after_commit
from capacity.schedules import deployment_schedule_delete, deployment_schedule_sync
from capacity.selling.at_risk import capacity_change
from capacity.selling.entitlements import entitlement_grant, entitlement_withdraw
from capacity.telemetry.prometheus import validate_selector
from core import outbound
from core.audit import AuditedAdminMixin, ReadOnlyAdminMixin, actor_of
from core.errors import ConflictError, DomainError


class PublishedAdminMixin:
    """For ModelAdmins of what gateways read (docs/gateway-contract.md): a change saved in the
    admin is published to Redis as soon as it commits, as the services' writes are, not at the
    next tick."""

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)  # type: ignore[misc]
        publish_after_commit(f"{obj._meta.model_name} changed in the admin")

    def delete_model(self, request, obj):
        name = obj._meta.model_name
        super().delete_model(request, obj)  # type: ignore[misc]
        publish_after_commit(f"{name} deleted in the admin")


class _Undo(Exception):
    pass


class CapacityCheckedForm(forms.ModelForm):
    """The admin refuses, as the API does, an edit that would leave sold capacity unserved
    (capacity.selling.at_risk): the edit is tried in a savepoint, measured and undone. There
    is no force here: force one through the API, with a reason."""

    def capacity_touched(self, original) -> dict | None:
        """The models and pools the edit touches; None when it changes no capacity."""
        return None

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
    class Meta:
        model = GpuPool
        fields = ["name", "gpu_type", "gpu_count"]

    def capacity_touched(self, original):
        if self.instance.gpu_count >= original.gpu_count:
            return None
        return {"pool_ids": [original.pk]}


class ServedModelAdminForm(CapacityCheckedForm):
    class Meta:
        model = ServedModel
        fields = [
            "name",
            "engine_model_id",
            "parameters_billions",
            "reference_gpu_type",
            "context_length_tokens",
            "headroom",
            "overcommit",
            "best_effort_ceiling_mu_per_minute",
            "best_effort_ceiling_replicas",
        ]

    def capacity_touched(self, original):
        names = ("headroom", "overcommit", "reference_gpu_type_id")
        if all(getattr(self.instance, n) == getattr(original, n) for n in names):
            return None
        return {"model_ids": [original.pk]}


class DeploymentAdminForm(CapacityCheckedForm):
    """The admin applies the same rules as the API: the pool fit, the actuator config and the
    engine profile."""

    endpoint_url = forms.URLField(required=False, max_length=500, assume_scheme="https")

    class Meta:
        model = Deployment
        fields = list(DEPLOYMENT_FIELDS)

    def capacity_touched(self, original):
        names = ("served_model_id", "gpu_pool_id", "gpus_per_replica", "max_replicas")
        if all(getattr(self.instance, n) == getattr(original, n) for n in names):
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
    list_display = ["name", "memory_gb", "hourly_cost_usd"]
    search_fields = ["name"]


@admin.register(GpuPool)
class GpuPoolAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    form = GpuPoolAdminForm
    list_display = ["name", "gpu_type", "gpu_count"]
    list_filter = ["gpu_type"]
    search_fields = ["name", "gpu_type__name"]
    list_select_related = ["gpu_type"]


@admin.register(ServedModel)
class ServedModelAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    form = ServedModelAdminForm
    list_display = [
        "name",
        "engine_model_id",
        "parameters_billions",
        "reference_gpu_type",
        "context_length_tokens",
    ]
    list_filter = ["reference_gpu_type"]
    search_fields = ["name", "engine_model_id"]
    list_select_related = ["reference_gpu_type"]


@admin.register(Deployment)
class DeploymentAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
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
        return bool(deployment.actuator_config_problem)

    # The admin saves the model itself; its nightly-benchmark beat row follows in the same
    # transaction (the admin wraps each save in one), as the services' writes do.
    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        deployment_schedule_sync(deployment=obj)

    # The admin's delete confirmation cannot be refused: a deletion that puts sold capacity at
    # risk goes ahead as forced, recorded in the audit log with who confirmed it.
    def delete_model(self, request, obj):
        pk = obj.pk
        with self._capacity_change(request, [obj]):
            super().delete_model(request, obj)
        deployment_schedule_delete(deployment_pk=pk)

    @transaction.atomic
    def delete_queryset(self, request, queryset):
        deployments = list(queryset)
        with self._capacity_change(request, deployments):
            super().delete_queryset(request, queryset)
        for deployment in deployments:
            deployment_schedule_delete(deployment_pk=deployment.pk)

    def _capacity_change(self, request, deployments):
        return capacity_change(
            action="deployment.delete",
            model_ids=[d.served_model_id for d in deployments],
            pool_ids=[d.gpu_pool_id for d in deployments],
            force=True,
            reason=f"deleted in the admin by {actor_of(user=request.user)}",
            obj=deployments[0] if len(deployments) == 1 else None,
        )


@admin.register(CostModel)
class CostModelAdmin(AuditedAdminMixin, admin.ModelAdmin):
    list_display = [
        "served_model",
        "gpu_type",
        "gpus_per_replica",
        "version",
        "status",
        "cv_mape",
        "alpha_mu_per_input_token",
        "beta_mu_per_output_token",
        "gamma_mu_per_request",
        "price_change_percent",
        "approved_by",
        "created_at",
    ]
    list_filter = ["status", "served_model", "gpu_type"]
    search_fields = ["served_model__name", "gpu_type__name", "approved_by", "rejected_by"]
    list_select_related = ["served_model", "gpu_type"]
    # A fitted version is evidence for the usage it priced, and its review the evidence for
    # its activation: all read only; its status moves only through the actions below, which
    # call the services the API and the planner use (so each records its approver and is
    # audited).
    readonly_fields = [field.name for field in CostModel._meta.fields if field.name != "id"]
    actions = ["activate_selected", "reject_selected", "retire_selected"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="price change")
    def price_change_percent(self, cost_model: CostModel) -> str:
        change = (cost_model.price_change or {}).get("change")
        return "—" if change is None else f"{change * 100:+.1f} %"

    def _each(self, request, queryset, service, done: str) -> None:
        changed = 0
        for cost_model in queryset:
            try:
                service(cost_model=cost_model)
            except DomainError as error:
                self.message_user(request, f"{cost_model}: {error.message}", level="error")
            else:
                changed += 1
        if changed:
            self.message_user(request, f"{changed} version(s) {done}.")

    @admin.action(description="Activate (retires the version it replaces; you approve it)")
    def activate_selected(self, request, queryset):
        from capacity.pricing.cost_models import cost_model_activate

        self._each(request, queryset, cost_model_activate, "activated")

    @admin.action(description="Reject (candidates only)")
    def reject_selected(self, request, queryset):
        from capacity.pricing.cost_models import cost_model_reject

        self._each(request, queryset, cost_model_reject, "rejected")

    @admin.action(description="Retire")
    def retire_selected(self, request, queryset):
        from capacity.pricing.cost_models import cost_model_retire

        self._each(
            request, queryset.exclude(status=CostModel.Status.RETIRED), cost_model_retire, "retired"
        )


class ReservationChangeInline(admin.TabularInline):
    model = ReservationChange
    extra = 0
    can_delete = False
    readonly_fields = ["kind", "changes", "changed_by", "changed_at"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Reservation)
class ReservationAdmin(AuditedAdminMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """Read-only here: selling goes through the API, which checks capacity under a lock."""

    list_display = [
        "customer",
        "served_model",
        "mu_per_minute",
        "starts_at",
        "ends_at",
        "status",
        "keep_warm",
    ]
    list_filter = ["status", "served_model", "keep_warm"]
    search_fields = ["customer__slug", "served_model__name", "notes"]
    list_select_related = ["customer", "served_model"]
    # Never deleted either: a sold reservation is billed; cancel it through the API.
    inlines = [ReservationChangeInline]


@admin.register(Entitlement)
class EntitlementAdmin(admin.ModelAdmin):
    """Grants and withdrawals go through the services (audited, published to gateways)."""

    list_display = ["customer", "served_model", "granted_by", "granted_at"]
    list_filter = ["served_model"]
    search_fields = ["customer__slug", "served_model__name"]
    fields = ["customer", "served_model"]

    def get_readonly_fields(self, request, obj=None):
        return ["customer", "served_model"] if obj is not None else []

    def has_change_permission(self, request, obj=None) -> bool:
        return obj is None and super().has_change_permission(request, obj)

    def save_model(self, request, obj, form, change):
        entitlement_grant(
            customer=obj.customer,
            served_model=obj.served_model,
            actor=actor_of(user=request.user),
        )
        stored = Entitlement.objects.get(customer=obj.customer, served_model=obj.served_model)
        obj.pk, obj.granted_at, obj.granted_by = stored.pk, stored.granted_at, stored.granted_by

    def delete_model(self, request, obj):
        entitlement_withdraw(
            customer=obj.customer, served_model=obj.served_model, actor=actor_of(user=request.user)
        )

    def delete_queryset(self, request, queryset):
        for entitlement in queryset.select_related("customer", "served_model"):
            self.delete_model(request, entitlement)


class RequestLimitAdminForm(forms.ModelForm):
    """The services' rules: a key of the customer, at least one limit, each at least 1."""

    class Meta:
        model = RequestLimit
        fields = ["customer", "api_key", *request_limits.LIMIT_FIELDS]

    def clean(self):
        cleaned = super().clean()
        customer = cleaned.get("customer") or getattr(self.instance, "customer", None)
        if customer is None:
            return cleaned
        api_key = cleaned.get("api_key") if "api_key" in cleaned else self.instance.api_key
        try:
            request_limits.check_request_limit(
                customer, api_key, {name: cleaned.get(name) for name in request_limits.LIMIT_FIELDS}
            )
        except DomainError as error:
            self.add_error(error.field if error.field in self.fields else None, error.message)
        return cleaned


@admin.register(RequestLimit)
class RequestLimitAdmin(admin.ModelAdmin):
    """Writes go through the services (audited, published to admission and gateways)."""

    form = RequestLimitAdminForm
    list_display = [
        "customer",
        "api_key",
        *request_limits.LIMIT_FIELDS,
        "updated_by",
        "updated_at",
    ]
    search_fields = ["customer__slug", "api_key__prefix"]
    list_select_related = ["customer", "api_key"]

    def get_readonly_fields(self, request, obj=None):
        # Which customer or key a row limits is fixed: delete it and add another.
        return ["customer", "api_key"] if obj is not None else []

    def save_model(self, request, obj, form, change):
        stored = request_limits.request_limit_set(
            customer=obj.customer,
            api_key=obj.api_key,
            actor=actor_of(user=request.user),
            **{name: getattr(obj, name) for name in request_limits.LIMIT_FIELDS},
        )
        obj.pk, obj.updated_at, obj.updated_by = stored.pk, stored.updated_at, stored.updated_by

    def delete_model(self, request, obj):
        request_limits.request_limit_delete(limit=obj, actor=actor_of(user=request.user))

    def delete_queryset(self, request, queryset):
        for limit in queryset.select_related("customer", "api_key"):
            self.delete_model(request, limit)


@admin.register(BudgetCap)
class BudgetCapAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Customers (or keys) whose best-effort admission a spent budget's hard cap refuses: set
    and lifted by billing's budget check (billing.budgets) through the audited service, never
    by hand."""

    list_display = ["customer", "api_key", "reason", "since"]
    search_fields = ["customer__slug", "api_key__prefix"]
    list_select_related = ["customer", "api_key"]


@admin.register(ReservationChange)
class ReservationChangeAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """A reservation's history: written by its services, never edited."""

    list_display = ["reservation", "kind", "changed_by", "changed_at"]
    list_filter = ["kind"]
    search_fields = ["changed_by", "reservation__customer__slug"]


@admin.register(UsageEvent)
class UsageEventAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Metered usage, what invoices are built on: stored only by ingestion (POST
    /api/v1/usage/events), never added, changed or deleted by hand, where no audit entry and
    no check (a model's context, the admission record) would stand behind it."""

    list_display = [
        "event_id",
        "customer",
        "served_model",
        "finished_at",
        "input_tokens",
        "output_tokens",
        "outcome",
        "admission_class",
        "verification",
        "self_reported",
        "api_key_prefix",
        "mu",
        "guaranteed_mu",
        "best_effort_mu",
        "rolled_up",
    ]
    list_filter = [
        "outcome",
        "admission_class",
        "verification",
        "self_reported",
        "rolled_up",
        "served_model",
    ]
    search_fields = ["event_id", "customer__slug", "api_key_prefix"]
    list_select_related = ["customer", "served_model"]
    show_full_result_count = False  # counting millions of events on every page would crawl


@admin.register(FallbackAdmission)
class FallbackAdmissionAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Decisions the Redis-down fallback made: evidence for billing, so read-only."""

    list_display = [
        "decided_at",
        "customer",
        "served_model",
        "request_id",
        "admission_class",
        "api_key_prefix",
    ]
    list_filter = ["admission_class", "served_model"]
    search_fields = ["request_id", "customer__slug"]
    list_select_related = ["customer", "served_model"]


@admin.register(UsageKeyMinute)
class UsageKeyMinuteAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """What each customer key's requests used per model and minute: rolled up from the events
    (capacity.metering.rollups), what a key's budget is priced from; read-only."""

    list_display = [
        "customer",
        "api_key_prefix",
        "served_model",
        "minute",
        "requests",
        "mu",
        "best_effort_mu",
    ]
    list_filter = ["served_model"]
    search_fields = ["customer__slug", "api_key_prefix"]
    list_select_related = ["customer", "served_model"]
    show_full_result_count = False


@admin.register(UsageMinute)
class UsageMinuteAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Each customer's usage per model and minute: rolled up from the events
    (capacity.metering.rollups), what invoices and the allocation tick read; read-only."""

    list_display = ["customer", "served_model", "minute", "requests", "mu", "refused_requests"]
    list_filter = ["served_model"]
    search_fields = ["customer__slug"]
    list_select_related = ["customer", "served_model"]
    show_full_result_count = False


@admin.register(AllocationDecision)
class AllocationDecisionAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """The allocation tick's decisions, the GPU-hours billing's margin counts: read-only."""

    list_display = [
        "created_at",
        "deployment",
        "current_replicas",
        "recommended_replicas",
        "target_replicas",
        "actuator_kind",
        "actuator_ok",
    ]
    list_filter = ["actuator_ok", "actuator_kind", "served_model"]
    search_fields = ["deployment__name", "actuator_error"]
    list_select_related = ["deployment"]
    show_full_result_count = False


@admin.register(AdmissionAllowance)
class AdmissionAllowanceAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """What the allocation tick allows each customer now: written by every tick; read-only."""

    list_display = [
        "customer",
        "served_model",
        "guaranteed_mu_per_minute",
        "best_effort_mu_per_minute",
        "updated_at",
    ]
    list_filter = ["served_model"]
    search_fields = ["customer__slug"]
    list_select_related = ["customer", "served_model"]


@admin.register(ActuatorCircuit)
class ActuatorCircuitAdmin(admin.ModelAdmin):
    """Resetting a circuit (deleting the row) lets the next tick try the deployment again."""

    list_display = ["deployment", "consecutive_failures", "opened_until", "updated_at"]
    search_fields = ["deployment__name", "last_error"]
    list_select_related = ["deployment"]


@admin.register(TickHeartbeat)
class TickHeartbeatAdmin(admin.ModelAdmin):
    """The allocation loop's pulse, written by every tick; its age is on /readyz, /metrics and
    the planner's pages (capacity.allocation.heartbeat). Read-only: only ticks write it."""

    list_display = ["ticked_at", "tick_id", "tick_seconds", "stale_since"]
    readonly_fields = ["ticked_at", "tick_id", "tick_seconds", "stale_since"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(CapacitySample)
class CapacitySampleAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Written by the allocation tick once a minute (used MU among them, from the usage
    rollups); the planner's fleet page charts them. Read-only."""

    list_display = [
        "served_model",
        "minute",
        "deployable_mu_per_minute",
        "hot_mu_per_minute",
        "sold_mu_per_minute",
        "used_mu_per_minute",
    ]
    list_filter = ["served_model"]
    date_hierarchy = "minute"
    list_select_related = ["served_model"]
    show_full_result_count = False


@admin.register(CapacityRisk)
class CapacityRiskAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Each model's oversold state and guaranteed shortfall, as the last re-check stored them
    (capacity.selling.at_risk): written by catalogue and pricing changes and by the tick."""

    list_display = [
        "served_model",
        "oversold_mu_per_minute",
        "oversold_since",
        "oversold_at",
        "guaranteed_shortfall_mu_per_minute",
        "guaranteed_shortfall_since",
        "checked_at",
    ]
    list_select_related = ["served_model"]


# --- Runtime health (capacity.health.probes, capacity.health.degradation) -------------------------


class _WrittenBySystem(admin.ModelAdmin):
    """Rows the probes or the degradation loop write: read only here."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(_WrittenBySystem):
    list_display = [
        "deployment",
        "key",
        "state",
        "consecutive_failures",
        "last_probe_at",
        "last_latency_ms",
        "url",
    ]
    list_filter = ["state", "deployment"]
    search_fields = ["deployment__name", "key", "url", "last_error"]
    list_select_related = ["deployment"]


@admin.register(DeploymentFingerprint)
class DeploymentFingerprintAdmin(AuditedAdminMixin, admin.ModelAdmin):
    """Deleting a fingerprint makes the next good probe answer the known-good one."""

    list_display = ["deployment", "answer", "recorded_at", "recorded_from"]
    search_fields = ["deployment__name", "answer"]
    list_select_related = ["deployment"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ProbeResult)
class ProbeResultAdmin(_WrittenBySystem):
    list_display = ["at", "replica", "outcome", "latency_ms"]
    list_filter = ["outcome"]
    search_fields = ["replica__deployment__name", "replica__key", "detail"]
    list_select_related = ["replica__deployment"]
    show_full_result_count = False


class IncidentStepInline(admin.TabularInline):
    model = IncidentStep
    extra = 0
    can_delete = False
    readonly_fields = ["step", "at", "detail"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Incident)
class IncidentAdmin(_WrittenBySystem):
    list_display = [
        "detected_at",
        "deployment",
        "replica",
        "cause",
        "restart_requested_at",
        "ready_at",
    ]
    list_filter = ["cause", "deployment"]
    search_fields = ["deployment__name", "replica__key", "detail", "restart_error"]
    list_select_related = ["deployment", "replica__deployment"]
    inlines = [IncidentStepInline]


@admin.register(IncidentStep)
class IncidentStepAdmin(_WrittenBySystem):
    list_display = ["incident", "step", "at"]
    list_filter = ["step"]
    search_fields = ["incident__deployment__name", "detail"]
    list_select_related = ["incident__replica__deployment"]


class DegradationPolicyAdminForm(forms.ModelForm):
    """The same rules as the planner form and the API, said on the fields."""

    class Meta:
        model = DegradationPolicy
        fields = [
            "served_model",
            "enabled",
            "degrade_below",
            "recover_at",
            "window_seconds",
            "hysteresis_seconds",
            "max_tokens_cap",
            "fallback_model",
        ]

    def clean(self):
        from capacity.health.services import policy_problems

        cleaned = super().clean()
        served_model = cleaned.get("served_model")
        needed = ("degrade_below", "recover_at", "window_seconds", "hysteresis_seconds")
        if served_model is not None and all(cleaned.get(name) is not None for name in needed):
            for field, reasons in policy_problems(served_model, cleaned).items():
                for reason in reasons:
                    self.add_error(field, reason)
        return cleaned


@admin.register(DegradationPolicy)
class DegradationPolicyAdmin(PublishedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    form = DegradationPolicyAdminForm
    list_display = [
        "served_model",
        "enabled",
        "degrade_below",
        "recover_at",
        "window_seconds",
        "hysteresis_seconds",
        "max_tokens_cap",
        "fallback_model",
    ]
    list_filter = ["enabled"]
    search_fields = ["served_model__name"]
    list_select_related = ["served_model", "fallback_model"]


@admin.register(DegradationState)
class DegradationStateAdmin(_WrittenBySystem):
    list_display = ["served_model", "level", "healthy_share", "changed_at", "evaluated_at"]
    list_filter = ["level"]
    search_fields = ["served_model__name"]
    list_select_related = ["served_model"]


@admin.register(DegradationChange)
class DegradationChangeAdmin(_WrittenBySystem):
    list_display = ["at", "served_model", "from_level", "to_level", "healthy_share", "reason"]
    list_filter = ["served_model", "to_level"]
    search_fields = ["served_model__name", "reason"]
    list_select_related = ["served_model"]
