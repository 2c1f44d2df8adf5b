"""Reads of invoices for the planner's pages."""

from django.db.models import Count, Q, QuerySet

from billing.models import Invoice, InvoiceLine


def invoices_with_line_count(
    *,
    status: str = "",
    period_year: int | None = None,
    period_month: int | None = None,
    customer_text: str = "",
) -> QuerySet[Invoice]:
    """Invoices (with `line_count`), newest period first, narrowed to a status, a month and a
    customer whose slug or name contains the text, each when given."""
    invoices = Invoice.objects.select_related("customer").annotate(line_count=Count("lines"))
    if status:
        invoices = invoices.filter(status=status)
    if period_year is not None and period_month is not None:
        invoices = invoices.filter(period_start__year=period_year, period_start__month=period_month)
    if customer_text:
        invoices = invoices.filter(
            Q(customer__slug__icontains=customer_text) | Q(customer__name__icontains=customer_text)
        )
    return invoices.order_by("-period_start", "customer__slug", "-id")


def any_invoices() -> bool:
    """Whether any invoice exists."""
    return Invoice.objects.exists()


def invoices_with_customer() -> QuerySet[Invoice]:
    """Every invoice, with its customer."""
    return Invoice.objects.select_related("customer")


def lines_of_invoice(invoice: Invoice) -> QuerySet[InvoiceLine]:
    """The invoice's lines, in the exports' order (kind, then as made)."""
    return invoice.lines.select_related("served_model", "reservation").order_by("kind", "pk")


def recent_invoices_of_customer(customer, *, limit: int = 12) -> QuerySet[Invoice]:
    """The customer's latest invoices (at most `limit`), newest period first."""
    return customer.invoices.order_by("-period_start", "-id")[:limit]


def invoices_of_customer(customer) -> QuerySet[Invoice]:
    """All of the customer's invoices, the newest period first."""
    return customer.invoices.order_by("-period_start", "-id")


def invoice_of_customer(customer, pk: int) -> Invoice | None:
    """The customer's invoice with this id; None when it has none (or it is another's)."""
    return Invoice.objects.filter(customer=customer, pk=pk).select_related("customer").first()
