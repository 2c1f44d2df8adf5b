"""What the admin modules of capacity share. (The read-only mixin and the audited one are the
ground floor's: core.audit.)"""

from django.contrib import admin

from capacity.hooks import gateway_state_changed


class PublishedAdminMixin:
    """For ModelAdmins of what gateways read (docs/gateway-contract.md): a change saved in the
    admin is published to Redis as soon as it commits, as the services' writes are, not at the
    next tick."""

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)  # type: ignore[misc]
        gateway_state_changed(f"{obj._meta.model_name} changed in the admin")

    def delete_model(self, request, obj):
        name = obj._meta.model_name
        super().delete_model(request, obj)  # type: ignore[misc]
        gateway_state_changed(f"{name} deleted in the admin")


class WrittenBySystemAdmin(admin.ModelAdmin):
    """Rows the system writes (the probes, the degradation loop, a fit and its services): never
    added or edited by hand here, though a row may be deleted."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
