from django.contrib import admin

from billing.models import Invoice, InvoiceLine, RateCard


@admin.register(RateCard)
class RateCardAdmin(admin.ModelAdmin):
    list_display = (
        "served_model",
        "effective_from",
        "currency",
        "reserved_price_per_mu_minute_hour",
        "best_effort_price_per_1000_mu",
    )
    list_filter = ("served_model", "currency")
    list_select_related = ("served_model",)


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = ("kind", "description", "quantity", "unit", "unit_price", "amount")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    """Invoices are made by generate_invoices and frozen once issued: read-only here."""

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
