from django import forms
from django.contrib import admin

from billing.latency import latency_sla_clean
from billing.models import Budget, BudgetAlert, Invoice, InvoiceLine, RateCard
from billing.rates import issued_through, rate_card_used
from core.audit import AuditedAdminMixin, ReadOnlyAdminMixin
from core.errors import DomainError


class RateCardAdminForm(forms.ModelForm):
    """The API's rules: no card takes effect inside an issued period; a latency SLA is an
    objective with well-formed tiers."""

    class Meta:
        model = RateCard
        fields = [
            "served_model",
            "effective_from",
            "currency",
            "reserved_price_per_mu_minute_hour",
            "best_effort_price_per_1000_mu",
            "keep_warm_price_per_mu_minute_hour",
            "ttft_objective_ms",
            "latency_credit_tiers",
        ]

    def clean(self):
        cleaned = super().clean()
        try:
            cleaned["latency_credit_tiers"] = latency_sla_clean(
                ttft_objective_ms=cleaned.get("ttft_objective_ms"),
                latency_credit_tiers=cleaned.get("latency_credit_tiers"),
            )
        except DomainError as error:
            self.add_error(error.field, error.message)
        effective_from = cleaned.get("effective_from")
        frozen_until = issued_through()
        changed_date = self.instance.pk is None or "effective_from" in self.changed_data
        if effective_from and frozen_until and changed_date and effective_from < frozen_until:
            self.add_error(
                "effective_from",
                f"Invoices are issued up to {frozen_until:%Y-%m-%d %H:%M} UTC; a rate card may "
                "not take effect inside an issued period.",
            )
        return cleaned


@admin.register(RateCard)
class RateCardAdmin(AuditedAdminMixin, admin.ModelAdmin):
    form = RateCardAdminForm
    list_display = (
        "served_model",
        "effective_from",
        "currency",
        "reserved_price_per_mu_minute_hour",
        "best_effort_price_per_1000_mu",
        "keep_warm_price_per_mu_minute_hour",
        "ttft_objective_ms",
    )
    list_filter = ("served_model", "currency")
    list_select_related = ("served_model",)

    # A card that priced an issued invoice is evidence for it: publish a new version instead.
    def has_change_permission(self, request, obj=None) -> bool:
        return obj is None or not rate_card_used(obj)

    def has_delete_permission(self, request, obj=None) -> bool:
        return obj is None or not rate_card_used(obj)


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = ("kind", "description", "quantity", "unit", "unit_price", "amount")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Invoice)
class InvoiceAdmin(AuditedAdminMixin, admin.ModelAdmin):
    """Invoices are made by invoice_generate and frozen once issued: read-only here."""

    list_display = ("customer", "period_start", "status", "currency", "total")
    list_filter = ("status", "period_start", "currency")
    list_select_related = ("customer",)
    search_fields = ("customer__slug", "customer__name")
    inlines = [InvoiceLineInline]
    readonly_fields = (
        "customer",
        "period_start",
        "status",
        "currency",
        "subtotal",
        "credits",
        "total",
        "generated_at",
        "issued_at",
    )

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        # An issued invoice was sent: it stays (void it through a new one, never delete it).
        return obj is not None and obj.status == Invoice.Status.DRAFT


@admin.register(InvoiceLine)
class InvoiceLineAdmin(admin.ModelAdmin):
    """Lines are part of their invoice: read-only here."""

    list_display = ("invoice", "kind", "description", "amount")
    list_filter = ("kind",)
    list_select_related = ("invoice__customer",)
    readonly_fields = [f.name for f in InvoiceLine._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class BudgetAdminForm(forms.ModelForm):
    """The API's rule: a key's budget is one of the customer's keys."""

    class Meta:
        model = Budget
        fields = ["customer", "api_key", "monthly_amount", "currency", "hard_cap", "alert_email"]

    def clean(self):
        cleaned = super().clean()
        customer, api_key = cleaned.get("customer"), cleaned.get("api_key")
        if customer is not None and api_key is not None and api_key.customer_id != customer.pk:
            self.add_error("api_key", f"The key {api_key.prefix} is not one of {customer}'s keys.")
        return cleaned


@admin.register(Budget)
class BudgetAdmin(AuditedAdminMixin, admin.ModelAdmin):
    """A monthly budget of a customer, or of one of its keys; the cap follows at the next check
    (billing.budgets)."""

    list_display = ("customer", "api_key", "monthly_amount", "currency", "hard_cap", "alert_email")
    search_fields = ("customer__slug", "api_key__prefix")
    list_select_related = ("customer", "api_key")
    raw_id_fields = ("api_key",)
    form = BudgetAdminForm


@admin.register(BudgetAlert)
class BudgetAlertAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Alerts claimed and sent by the budget check: a record, never edited."""

    list_display = (
        "kind",
        "customer",
        "period",
        "threshold_percent",
        "channel",
        "sent_at",
        "error",
    )
    list_filter = ("kind", "channel")
    search_fields = ("customer__slug",)
