"""Admission's admin pages: request limits (through the audited services), budget caps and
the Redis-down fallback's decisions (both read only)."""

from django import forms
from django.contrib import admin

from capacity.admission import limits as request_limits
from capacity.models import BudgetCap, FallbackAdmission, RequestLimit
from core.audit import ReadOnlyAdminMixin, actor_of
from core.errors import DomainError


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
        """Sets the limits through the service, then shows the row it stored."""
        stored = request_limits.request_limit_set(
            customer=obj.customer,
            api_key=obj.api_key,
            actor=actor_of(user=request.user),
            **{name: getattr(obj, name) for name in request_limits.LIMIT_FIELDS},
        )
        obj.pk, obj.updated_at, obj.updated_by = stored.pk, stored.updated_at, stored.updated_by

    def delete_model(self, request, obj):
        """Deletes through the service."""
        request_limits.request_limit_delete(limit=obj, actor=actor_of(user=request.user))

    def delete_queryset(self, request, queryset):
        """Deletes each, through the service."""
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
