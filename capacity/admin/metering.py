"""Metering's admin pages, all read only: usage events (what invoices are built on), their
rollups per minute, and the capacity history the tick writes from them."""

from django.contrib import admin

from capacity.models import CapacitySample, UsageEvent, UsageKeyMinute, UsageMinute
from core.audit import ReadOnlyAdminMixin


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
