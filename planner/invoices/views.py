"""Invoices: every customer's drafts and issued invoices, a detail with its lines, issuing."""

from django.contrib import messages
from django.db.models import Count, Q
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from billing.generation import invoice_issue
from billing.models import Invoice
from controlplane.audit import entries_about
from controlplane.errors import DomainError
from planner.access import planner_required
from planner.audit.views import audit_link
from planner.paging import page_of, query_without


@planner_required
def invoice_list(request):
    invoices = Invoice.objects.select_related("customer").annotate(line_count=Count("lines"))
    status = request.GET.get("status", "")
    if status in Invoice.Status.values:
        invoices = invoices.filter(status=status)
    period = request.GET.get("period", "").strip()
    if period:
        year, _, month = period.partition("-")
        # Four digits: a longer year overflowed the lookup into a 500.
        if len(year) == 4 and year.isdigit() and year != "0000" and month.isdigit():
            invoices = invoices.filter(period_start__year=int(year), period_start__month=int(month))
    query = request.GET.get("q", "").strip()
    if query:
        invoices = invoices.filter(
            Q(customer__slug__icontains=query) | Q(customer__name__icontains=query)
        )
    context = {
        "page": page_of(request, invoices.order_by("-period_start", "customer__slug", "-id")),
        "query": query_without(request),
        "status": status,
        "period": period,
        "q": query,
        "statuses": Invoice.Status.choices,
        "any_invoices": Invoice.objects.exists(),
    }
    return render(request, "planner/invoices/list.html", context)


@planner_required
def invoice_detail(request, pk):
    invoice = get_object_or_404(Invoice.objects.select_related("customer"), pk=pk)
    lines = invoice.lines.select_related("served_model", "reservation").order_by("kind", "pk")
    context = {
        "invoice": invoice,
        "lines": lines,
        "history": entries_about(invoice, limit=20),
        "history_link": audit_link(invoice),
    }
    return render(request, "planner/invoices/detail.html", context)


@planner_required
@require_POST
def invoice_issue_view(request, pk):
    invoice = get_object_or_404(Invoice, pk=pk)
    try:
        invoice_issue(invoice)
    except DomainError as error:
        messages.error(request, f"Not issued: {error.message}")
    else:
        messages.success(request, "Invoice issued: it can no longer change.")
    return redirect("planner:invoices:detail", pk=pk)
