"""The customer portal's pages: a customer's use of its reservations (the planner's chart), its
usage receipts, its API keys, its limits and its invoices. Every read goes through a selector
scoped to the page's customer (portal.access puts it on the request), every write through the
same services as the API and the planner.
"""

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST, require_safe

from accounts.principals import user_is_planner
from accounts.selectors import (
    api_key_of_customer,
    api_keys_of_customer_newest_first,
    membership_of_customer,
    memberships_of_user,
)
from accounts.services import api_key_create, api_key_revoke, membership_remove
from accounts.throttling import counted_as_export
from billing.budgets import budget_statuses, budgets_of_customer
from billing.exports import INVOICE_FORMATS, invoice_download
from billing.models import Invoice
from billing.selectors import invoice_of_customer, invoices_of_customer, lines_of_invoice
from capacity.admission.limits import request_limits_of_customer
from capacity.allocation.selectors import admission_allowances_of_customer
from capacity.metering.selectors import usage_events_of_customer_newest_first
from capacity.selling.entitlements import entitled_model_names
from capacity.selling.selectors import reservations_of_customer
from core.audit import actor_of
from core.errors import DomainError
from planner.customers.charts import utilisation_context
from planner.customers.forms import ApiKeyForm, MembershipRemoveForm
from planner.customers.people import people_page, removed_message
from planner.paging import page_of
from portal.access import PortalAccess, portal_page

# Receipts page over the newest events only: a count over every event a large customer ever
# sent would cost more than the page; older requests are on the invoices.
RECEIPTS_LIMIT = 10_000
RECEIPTS_PER_PAGE = 50


def home(request: HttpRequest) -> HttpResponse:
    """The user's customers: straight to the one it belongs to, else a choice."""
    if not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    memberships = list(memberships_of_user(request.user))
    if len(memberships) == 1:
        return redirect("portal:overview", slug=memberships[0].customer.slug)
    if not memberships and user_is_planner(request.user):
        # The site's login sends everyone here; planners belong to the planner UI.
        return redirect("planner:fleet")
    return render(request, "portal/home.html", {"memberships": memberships})


@portal_page
@require_safe
def overview(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """The customer's use of its reservations per model (the planner's chart), and the models
    it may call."""
    context = {
        "access": access,
        "section": "overview",
        "entitled_models": entitled_model_names(access.customer),
        "whose": "your",
        **utilisation_context(request, access.customer),
    }
    return render(request, "portal/overview.html", context)


@portal_page
@require_safe
def usage(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """The customer's usage receipts, newest first (the newest RECEIPTS_LIMIT events)."""
    events = usage_events_of_customer_newest_first(access.customer, limit=RECEIPTS_LIMIT)
    context = {
        "access": access,
        "section": "usage",
        "page": page_of(request, events, per_page=RECEIPTS_PER_PAGE),
        "limit": RECEIPTS_LIMIT,
    }
    return render(request, "portal/usage.html", context)


def _keys_page(
    request: HttpRequest, access: PortalAccess, *, status: int = 200, **extra: Any
) -> HttpResponse:
    context = {
        "access": access,
        "section": "keys",
        "keys": page_of(request, api_keys_of_customer_newest_first(access.customer), per_page=20),
        "key_form": ApiKeyForm() if access.manages_keys else None,
        "now": timezone.now(),
        **extra,
    }
    return render(request, "portal/keys.html", context, status=status)


@portal_page
@require_safe
def keys(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """The customer's API keys; its owners also see the form that creates one."""
    return _keys_page(request, access)


# Membership first (404 for anyone else, whatever the method), then the role, then the method.
@portal_page(owners_only=True)
@require_POST
def key_new(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """An owner creates a key; its plaintext is shown in this response only."""
    form = ApiKeyForm(request.POST)
    if form.is_valid():
        try:
            created = api_key_create(
                customer=access.customer,
                created_by=request.user,
                actor=actor_of(user=request.user),
                **form.cleaned_data,
            )
        except DomainError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            # The plaintext is in this response only: not stored, not in the session, never
            # shown again (the list shows the prefix).
            return _keys_page(request, access, status=201, new_key=created)
    return _keys_page(request, access, status=400, key_form=form)


@portal_page(owners_only=True)
@require_POST
def key_revoke(request: HttpRequest, access: PortalAccess, pk: int) -> HttpResponse:
    """An owner revokes one of the customer's keys: it no longer authenticates."""
    api_key = api_key_of_customer(access.customer, pk)
    if api_key is None:
        raise Http404("No such key for this customer.")
    api_key_revoke(api_key=api_key, actor=actor_of(user=request.user))
    messages.success(request, f"Key {api_key.prefix} revoked: it no longer authenticates.")
    return redirect("portal:keys", slug=access.customer.slug)


@portal_page
@require_safe
def people(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """The customer's people and the keys each made; owners remove people (not themselves:
    the customer keeps an owner), offered to revoke the keys the person made."""
    context = {
        "access": access,
        "section": "people",
        "people": people_page(request, access.customer, per_page=50),
    }
    return render(request, "portal/people.html", context)


@portal_page(owners_only=True)
@require_POST
def person_remove(request: HttpRequest, access: PortalAccess, pk: int) -> HttpResponse:
    """An owner removes another person from the customer, and the keys they made if asked."""
    membership = membership_of_customer(access.customer, pk)
    if membership is None:
        raise Http404("No such person of this customer.")
    if membership.user_id == request.user.pk:
        # The last owner removing themselves would leave the customer with no one to manage
        # its keys; another owner (or a planner) removes an owner.
        messages.error(request, "You cannot remove yourself: another owner can.")
        return redirect("portal:people", slug=access.customer.slug)
    form = MembershipRemoveForm(request.POST)
    form.is_valid()  # a checkbox: always valid, absent is False
    removed = membership_remove(
        membership=membership,
        revoke_keys=form.cleaned_data["revoke_keys"],
        actor=actor_of(user=request.user),
    )
    messages.success(request, removed_message(removed, access.customer))
    return redirect("portal:people", slug=access.customer.slug)


@portal_page
@require_safe
def limits(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """What the customer may send: its reservations, allowances, request limits, budgets and
    the API's rates."""
    customer = access.customer
    context = {
        "access": access,
        "section": "limits",
        "entitled_models": entitled_model_names(customer),
        "reservations": page_of(request, reservations_of_customer(customer), per_page=20),
        "allowances": admission_allowances_of_customer(customer),
        # The customer's own first, then its keys' (by prefix).
        "request_limits": request_limits_of_customer(customer),
        "budgets": budget_statuses(budgets_of_customer(customer)),
        "write_rate": settings.API_THROTTLE_WRITES,
        "usage_rate": settings.API_THROTTLE_USAGE,
        "now": timezone.now(),
    }
    return render(request, "portal/limits.html", context)


@portal_page
@require_safe
def invoices(request: HttpRequest, access: PortalAccess) -> HttpResponse:
    """The customer's invoices, newest first."""
    context = {
        "access": access,
        "section": "invoices",
        "page": page_of(request, invoices_of_customer(access.customer), per_page=24),
        "formats": INVOICE_FORMATS.values(),
    }
    return render(request, "portal/invoices.html", context)


def _invoice_of(access: PortalAccess, pk: int) -> Invoice:
    invoice = invoice_of_customer(access.customer, pk)
    if invoice is None:
        raise Http404("No such invoice for this customer.")
    return invoice


@portal_page
@require_safe
def invoice(request: HttpRequest, access: PortalAccess, pk: int) -> HttpResponse:
    """One of the customer's invoices with its lines."""
    invoice = _invoice_of(access, pk)
    context = {
        "access": access,
        "section": "invoices",
        "invoice": invoice,
        "lines": lines_of_invoice(invoice),
        "formats": INVOICE_FORMATS.values(),
    }
    return render(request, "portal/invoice.html", context)


@portal_page
@require_safe
@counted_as_export
def invoice_file(
    request: HttpRequest, access: PortalAccess, pk: int, format_name: str
) -> HttpResponse:
    """One of the customer's invoices as a file (counted as an export against the user's
    rate)."""
    invoice = _invoice_of(access, pk)
    if format_name not in INVOICE_FORMATS:
        raise Http404(f"Invoices download as {', '.join(INVOICE_FORMATS)}.")
    return invoice_download(invoice, format_name)
