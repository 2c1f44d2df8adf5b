"""The cost models' admin page: fitted versions, read only, whose status moves only through
the repricing services (capacity.repricing.services), as the API's and the planner's do."""

from django.contrib import admin

from capacity.admin.shared import WrittenBySystemAdmin
from capacity.models import CostModel
from capacity.repricing.services import cost_model_activate, cost_model_reject, cost_model_retire
from core.audit import AuditedAdminMixin
from core.errors import DomainError


@admin.register(CostModel)
class CostModelAdmin(AuditedAdminMixin, WrittenBySystemAdmin):
    """Versions of fitted cost models with their review; activated, rejected or retired by the
    actions below, never edited."""

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

    @admin.display(description="price change")
    def price_change_percent(self, cost_model: CostModel) -> str:
        """The review's change of price against the active version, as a signed percentage."""
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
        """Activates each selected version through the service; refusals are shown, each."""
        self._each(request, queryset, cost_model_activate, "activated")

    @admin.action(description="Reject (candidates only)")
    def reject_selected(self, request, queryset):
        """Rejects each selected candidate through the service."""
        self._each(request, queryset, cost_model_reject, "rejected")

    @admin.action(description="Retire")
    def retire_selected(self, request, queryset):
        """Retires each selected version not retired already, through the service."""
        self._each(
            request, queryset.exclude(status=CostModel.Status.RETIRED), cost_model_retire, "retired"
        )
