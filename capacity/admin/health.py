"""Runtime health's admin pages (capacity.health.probes, capacity.health.degradation):
replicas, probes, incidents and degradation states, which the system writes (read only
here), and the degradation policies planners set (audited, published to gateways)."""

from django import forms
from django.contrib import admin

from capacity.admin.shared import PublishedAdminMixin, WrittenBySystemAdmin
from capacity.health.services import POLICY_FIELDS, policy_problems
from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    DeploymentFingerprint,
    Incident,
    IncidentStep,
    ProbeResult,
    Replica,
)
from core.audit import AuditedAdminMixin


@admin.register(Replica)
class ReplicaAdmin(WrittenBySystemAdmin):
    """Each deployment's replicas as the probes see them."""

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
class DeploymentFingerprintAdmin(AuditedAdminMixin, WrittenBySystemAdmin):
    """Deleting a fingerprint makes the next good probe answer the known-good one."""

    list_display = ["deployment", "answer", "recorded_at", "recorded_from"]
    search_fields = ["deployment__name", "answer"]
    list_select_related = ["deployment"]


@admin.register(ProbeResult)
class ProbeResultAdmin(WrittenBySystemAdmin):
    """Every probe's outcome and latency."""

    list_display = ["at", "replica", "outcome", "latency_ms"]
    list_filter = ["outcome"]
    search_fields = ["replica__deployment__name", "replica__key", "detail"]
    list_select_related = ["replica__deployment"]
    show_full_result_count = False


class IncidentStepInline(admin.TabularInline):
    """An incident's steps on its page, read only."""

    model = IncidentStep
    extra = 0
    can_delete = False
    readonly_fields = ["step", "at", "detail"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Incident)
class IncidentAdmin(WrittenBySystemAdmin):
    """A replica's failure, from detection through the restart to ready again."""

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
class IncidentStepAdmin(WrittenBySystemAdmin):
    """The steps of every incident."""

    list_display = ["incident", "step", "at"]
    list_filter = ["step"]
    search_fields = ["incident__deployment__name", "detail"]
    list_select_related = ["incident__replica__deployment"]


class DegradationPolicyAdminForm(forms.ModelForm):
    """The same rules as the planner form and the API, said on the fields."""

    class Meta:
        model = DegradationPolicy
        fields = ["served_model", *POLICY_FIELDS]

    def clean(self):
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
    """When a model degrades and recovers, per model: audited, published to gateways."""

    form = DegradationPolicyAdminForm
    list_display = ["served_model", *POLICY_FIELDS]
    list_filter = ["enabled"]
    search_fields = ["served_model__name"]
    list_select_related = ["served_model", "fallback_model"]


@admin.register(DegradationState)
class DegradationStateAdmin(WrittenBySystemAdmin):
    """Each model's degradation level now."""

    list_display = ["served_model", "level", "healthy_share", "changed_at", "evaluated_at"]
    list_filter = ["level"]
    search_fields = ["served_model__name"]
    list_select_related = ["served_model"]


@admin.register(DegradationChange)
class DegradationChangeAdmin(WrittenBySystemAdmin):
    """Each change of a model's degradation level, and why."""

    list_display = ["at", "served_model", "from_level", "to_level", "healthy_share", "reason"]
    list_filter = ["served_model", "to_level"]
    search_fields = ["served_model__name", "reason"]
    list_select_related = ["served_model"]
