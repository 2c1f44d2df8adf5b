from django.contrib import admin

from simulation.models import WhatIfRun


@admin.register(WhatIfRun)
class WhatIfRunAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "served_model",
        "trace_name",
        "trace_filename",
        "status",
        "progress_done",
        "progress_total",
        "requested_by",
        "created_at",
        "finished_at",
    ]
    list_filter = ["status", "trace_name", "served_model"]
    search_fields = ["served_model__name", "trace_name", "trace_filename", "error"]
    list_select_related = ["served_model", "requested_by"]
    readonly_fields = [
        "status",
        "progress_done",
        "progress_total",
        "progress_message",
        "error",
        "result",
        "created_at",
        "started_at",
        "finished_at",
    ]
