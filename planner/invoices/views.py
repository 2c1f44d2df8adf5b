"""Invoices: every customer's drafts and issued invoices, a detail with its lines, issuing."""

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from billing.generation import invoice_issue
from billing.models import Invoice
from billing.periods import period_bounds
from billing.selectors import (
    any_invoices,
    invoices_with_customer,
    invoices_with_line_count,
    lines_of_invoice,
)
from core.audit import entries_about
from core.errors import DomainError
from planner.access import planner_required
from planner.audit.views import audit_link
from planner.paging import page_of, query_without


@planner_required
def invoice_list(request: HttpRequest) -> HttpResponse:
    """Every customer's invoices, filtered by status, period (a month) and customer."""
    status = request.GET.get("status", "")
    period = request.GET.get("period", "").strip()
    period_first, period_error = None, ""
    if period:
        # Read as the API reads it (billing's one rule for a month): a period that is not one
        # matches nothing and says why.
        try:
            period_first, _, _ = period_bounds(period)
        except DomainError as error:
            period_error = error.message
    query = request.GET.get("q", "").strip()
    invoices = invoices_with_line_count(
        status=status if status in Invoice.Status.values else "",
        period_year=period_first.year if period_first else None,
        period_month=period_first.month if period_first else None,
        customer_text=query,
    )
    if period_error:
        invoices = invoices.none()
    context = {
        "page": page_of(request, invoices),
        "query": query_without(request),
        "status": status,
        "period": period,
        "period_error": period_error,
        "q": query,
        "statuses": Invoice.Status.choices,
        "any_invoices": any_invoices(),
    }
    return render(request, "planner/invoices/list.html", context)


@planner_required
def invoice_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One invoice with its lines and history."""
    invoice = get_object_or_404(invoices_with_customer(), pk=pk)
    lines = lines_of_invoice(invoice)
    context = {
        "invoice": invoice,
        "lines": lines,
        "history": entries_about(invoice, limit=20),
        "history_link": audit_link(invoice),
    }
    return render(request, "planner/invoices/detail.html", context)


@planner_required
@require_POST
def invoice_issue_view(request: HttpRequest, pk: int) -> HttpResponse:
    """Issue a draft: from then on it can no longer change."""
    invoice = get_object_or_404(Invoice, pk=pk)
    try:
        invoice_issue(invoice=invoice)
    except DomainError as error:
        messages.error(request, f"Not issued: {error.message}")
    else:
        messages.success(request, "Invoice issued: it can no longer change.")
    return redirect("planner:invoices:detail", pk=pk)
