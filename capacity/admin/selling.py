"""What is sold: reservations and their history (read only: selling goes through the API,
which checks capacity under a lock), entitlements (through the audited services) and each
model's oversold state (read only)."""

from django.contrib import admin

from capacity.models import CapacityRisk, Entitlement, Reservation, ReservationChange
from capacity.selling.entitlements import entitlement_grant, entitlement_withdraw
from core.audit import AuditedAdminMixin, ReadOnlyAdminMixin, actor_of


class ReservationChangeInline(admin.TabularInline):
    """A reservation's history on its page, read only."""

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


@admin.register(ReservationChange)
class ReservationChangeAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """A reservation's history: written by its services, never edited."""

    list_display = ["reservation", "kind", "changed_by", "changed_at"]
    list_filter = ["kind"]
    search_fields = ["changed_by", "reservation__customer__slug"]


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
        """Grants through the service, then shows the row it stored."""
        entitlement_grant(
            customer=obj.customer,
            served_model=obj.served_model,
            actor=actor_of(user=request.user),
        )
        stored = Entitlement.objects.get(customer=obj.customer, served_model=obj.served_model)
        obj.pk, obj.granted_at, obj.granted_by = stored.pk, stored.granted_at, stored.granted_by

    def delete_model(self, request, obj):
        """Withdraws through the service."""
        entitlement_withdraw(
            customer=obj.customer, served_model=obj.served_model, actor=actor_of(user=request.user)
        )

    def delete_queryset(self, request, queryset):
        """Withdraws each, through the service."""
        for entitlement in queryset.select_related("customer", "served_model"):
            self.delete_model(request, entitlement)


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
