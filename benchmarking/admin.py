from django.contrib import admin

from benchmarking.models import (
    BenchmarkRun,
    BenchmarkSample,
    BenchmarkSuite,
    CostModelSource,
    DeploymentSuite,
)
from core.audit import AuditedAdminMixin


@admin.register(BenchmarkSuite)
class BenchmarkSuiteAdmin(AuditedAdminMixin, admin.ModelAdmin):
    list_display = [
        "name",
        "slo_ttft_p95_ms",
        "slo_tpot_p95_ms",
        "duration_per_point_seconds",
        "max_concurrency",
        "created_at",
    ]
    search_fields = ["name", "description"]


# A sample's measured point, in the order the run's page and the list show it.
SAMPLE_POINT_FIELDS = [
    "input_len",
    "cached_input_len",
    "images",
    "output_len",
    "concurrency",
    "requests_per_s",
    "ttft_p95_ms",
    "tpot_p95_ms",
]


class BenchmarkSampleInline(admin.TabularInline):
    model = BenchmarkSample
    extra = 0
    can_delete = False
    fields = [
        *SAMPLE_POINT_FIELDS,
        "error_count",
        "slo_met",
        "sustainable",
    ]
    readonly_fields = fields


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "served_model",
        "gpu_type",
        "gpus_per_replica",
        "source",
        "status",
        "progress_done",
        "progress_total",
        "created_at",
        "finished_at",
    ]
    list_filter = ["status", "source", "served_model", "gpu_type"]
    search_fields = ["served_model__name", "gpu_type__name", "endpoint_url", "source_detail"]
    list_select_related = ["served_model", "gpu_type"]
    readonly_fields = [
        "status",
        "progress_done",
        "progress_total",
        "progress_message",
        "attempts",
        "error",
        "fit_error",
        "log",
        "created_at",
        "started_at",
        "heartbeat_at",
        "finished_at",
    ]
    inlines = [BenchmarkSampleInline]


@admin.register(BenchmarkSample)
class BenchmarkSampleAdmin(admin.ModelAdmin):
    list_display = ["run", *SAMPLE_POINT_FIELDS, "sustainable"]
    list_filter = ["sustainable", "slo_met"]
    search_fields = ["run__served_model__name"]
    list_select_related = ["run"]


class _ReferenceAdmin(admin.ModelAdmin):
    """A reference benchmarking keeps to a catalogue row: shown, never added or edited here;
    deleted only with the row it belongs to (the admin's delete of a deployment, a cost model,
    a suite or a run takes it along, so deleting it must be allowed)."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(DeploymentSuite)
class DeploymentSuiteAdmin(_ReferenceAdmin):
    """Which suite each deployment's nightly benchmark runs: set on the deployment (its
    `benchmark_suite`, in the API or the deployment's admin page), shown here."""

    list_display = ["deployment", "suite"]
    list_select_related = ["deployment", "suite"]
    search_fields = ["deployment__name", "suite__name"]


@admin.register(CostModelSource)
class CostModelSourceAdmin(_ReferenceAdmin):
    """The run each cost model version was fitted from, recorded by the fit."""

    list_display = ["cost_model", "run"]
    list_select_related = ["cost_model__served_model", "cost_model__gpu_type", "run"]
