"""The allocation loop's admin pages: its decisions, what it allows each customer, its
pulse, each model's prediction (all written by the tick or the forecast's fit, read only) and
the actuator circuits (reset by deleting)."""

from django.contrib import admin

from capacity.models import (
    ActuatorCircuit,
    AdmissionAllowance,
    AllocationDecision,
    ModelPrediction,
    TickHeartbeat,
)
from core.audit import ReadOnlyAdminMixin


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
class TickHeartbeatAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """The allocation loop's pulse, written by every tick; its age is on /readyz, /metrics and
    the planner's pages (capacity.allocation.heartbeat). Read-only: only ticks write it."""

    list_display = ["ticked_at", "tick_id", "tick_seconds", "stale_since"]
    readonly_fields = ["ticked_at", "tick_id", "tick_seconds", "stale_since"]


@admin.register(ModelPrediction)
class ModelPredictionAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Each model's forecast (written by its fit) and what the last tick did with it (rule 3c
    of capacity.allocation.policy): read-only. Prediction is switched per model with the served
    model's `prediction_enabled`."""

    list_display = [
        "served_model",
        "predictive",
        "set_by",
        "slo_correction",
        "slo_code",
        "delivered_slo_attainment",
        "burst_headroom_mu_per_minute",
        "forecast_now_mu_per_minute",
        "fitted_at",
        "decided_at",
    ]
    list_filter = ["predictive", "set_by", "slo_code"]
    search_fields = ["served_model__name", "fit_note"]
    list_select_related = ["served_model"]
