"""Customers: the list with reserved versus used, and a customer's page (utilisation chart,
reservations, API keys, request limits, invoices). Writes go through the same services as the
API."""

from datetime import datetime, timedelta
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from accounts.models import ApiKey, Customer
from accounts.selectors import (
    any_customers,
    api_key_ids_of_customer,
    api_key_of_customer,
    api_keys_of_customer_newest_first,
    customers_by_slug,
    membership_ids_of_customer,
    membership_of_customer,
)
from accounts.services import api_key_create, api_key_revoke, customer_create, membership_remove
from billing.selectors import recent_invoices_of_customer
from capacity.admission.limits import (
    request_limit_delete,
    request_limit_set,
    request_limits_of_customer,
)
from capacity.metering.selectors import (
    NO_USAGE,
    usage_totals_by_customer,
)
from capacity.models import RequestLimit, Reservation
from capacity.selling.entitlements import entitled_model_names
from capacity.selling.reservations import reservation_amend, reservation_cancel, reservation_create
from capacity.selling.selectors import (
    reservation_ids_of_customer,
    reservation_of_customer,
    reservations_at_risk_of_customer,
    reservations_of_customer,
    reserved_mu_per_minute_by_customer,
)
from core.audit import actor_of, entries_about
from core.errors import DomainError
from planner.access import planner_required
from planner.audit.views import audit_link
from planner.customers.charts import utilisation_context
from planner.customers.forms import (
    AmendForm,
    ApiKeyForm,
    CustomerForm,
    MembershipRemoveForm,
    RequestLimitForm,
    ReservationForm,
)
from planner.customers.people import people_page, removed_message
from planner.paging import page_of, query_without

USAGE_WINDOW = timedelta(hours=24)


def with_totals(customers: list[Customer], now: datetime) -> list[Customer]:
    """Reserved now, and used and refused over the last day, for these customers: two grouped
    queries whatever their number (a page of the list)."""
    ids = [customer.pk for customer in customers]
    reserved = reserved_mu_per_minute_by_customer(ids, now=now)
    used = usage_totals_by_customer(ids, since=now - USAGE_WINDOW)
    minutes = USAGE_WINDOW.total_seconds() / 60
    # For the list's template only: the figures beside each customer.
    for customer in customers:
        usage = used.get(customer.pk, NO_USAGE)
        customer.reserved_mu_per_minute = reserved.get(customer.pk) or 0.0  # type: ignore[attr-defined]
        customer.used_mu_per_minute = usage.mu / minutes  # type: ignore[attr-defined]
        customer.refused_requests = usage.refused_requests  # type: ignore[attr-defined]
        customer.guaranteed_refused_requests = usage.guaranteed_refused_requests  # type: ignore[attr-defined]
    return customers


def _list_page(request: HttpRequest, form: CustomerForm, status: int = 200) -> HttpResponse:
    query = request.GET.get("q", "").strip()
    customers = customers_by_slug(text=query)
    # Page over the bare rows, then total only the page's: totals computed in the same query
    # would be computed for every row an OFFSET skips too (the last of 200 pages took 0.5 s).
    page = page_of(request, customers)
    page.object_list = with_totals(list(page.object_list), timezone.now())
    context = {
        "form": form,
        "q": query,
        "page": page,
        "query": query_without(request),
        "any_customers": bool(query) or any_customers(),
    }
    return render(request, "planner/customers/list.html", context, status=status)


@planner_required
def customer_list(request: HttpRequest) -> HttpResponse:
    """The customers with what each reserves and used (searched by `?q=`); POST creates one."""
    if request.method == "POST":
        form = CustomerForm(request.POST)
        if form.is_valid():
            try:
                customer = customer_create(**form.cleaned_data)
            except DomainError as error:
                form.add_error(error.field if error.field in form.fields else None, error.message)
            else:
                messages.success(request, f"Customer {customer.slug} created.")
                return redirect("planner:customers:detail", slug=customer.slug)
        return _list_page(request, form, status=400)
    return _list_page(request, CustomerForm())


def detail_context(request: HttpRequest, customer: Customer, **extra: Any) -> dict[str, Any]:
    """Everything the customer's page draws; `extra` replaces parts of it (a form sent back
    with its errors, a key's plaintext shown once, a refusal)."""
    reservations = reservations_of_customer(customer)
    keys = api_keys_of_customer_newest_first(customer)
    request_limits = request_limits_of_customer(customer)
    history = entries_about(
        customer,
        ("accounts.apikey", api_key_ids_of_customer(customer)),
        ("capacity.reservation", reservation_ids_of_customer(customer)),
        ("accounts.membership", membership_ids_of_customer(customer)),
        ("capacity.requestlimit", [limit.pk for limit in request_limits]),
        limit=20,
    )
    context = {
        "customer": customer,
        "entitled_models": entitled_model_names(customer),
        **utilisation_context(request, customer),
        "reservations": page_of(request, reservations, param="reservations_page", per_page=20),
        # Sold beyond what the fleet serves now (capacity.selling.at_risk): the oversold state.
        "at_risk_ids": {r.pk for r in reservations_at_risk_of_customer(customer)},
        "keys": page_of(request, keys, param="keys_page", per_page=20),
        "people": people_page(request, customer),
        "invoices": recent_invoices_of_customer(customer, limit=12),
        "reservation_form": ReservationForm(),
        "key_form": ApiKeyForm(),
        "request_limits": request_limits,
        "limit_form": RequestLimitForm(keys=_usable_keys(customer)),
        "now": timezone.now(),
        "history": history,
        "history_link": audit_link(customer),
    }
    context.update(extra)
    return context


@planner_required
def detail(request: HttpRequest, slug: str) -> HttpResponse:
    """One customer's page: its use of its reservations, its keys, people, limits, invoices."""
    customer = get_object_or_404(Customer, slug=slug)
    return render(request, "planner/customers/detail.html", detail_context(request, customer))


def _usable_keys(customer: Customer) -> list[ApiKey]:
    return [key for key in api_keys_of_customer_newest_first(customer) if key.revoked_at is None]


def _actor(request: HttpRequest) -> str:
    return f"planner:{request.user.get_username()}"


@planner_required
@require_POST
def reservation_new(request: HttpRequest, slug: str) -> HttpResponse:
    """Reserve capacity for the customer; a refusal is shown whole on its page."""
    customer = get_object_or_404(Customer, slug=slug)
    form = ReservationForm(request.POST)
    problem = None
    if form.is_valid():
        try:
            reservation = reservation_create(
                customer=customer, actor=_actor(request), **form.cleaned_data
            )
        except DomainError as error:
            problem = error
            # A refusal with its numbers is shown whole above the form; a plain invalid
            # value is marked on its field.
            if error.field in form.fields and not error.details:
                form.add_error(error.field, error.message)
        else:
            messages.success(
                request,
                f"Reserved {reservation.mu_per_minute:g} MU/min "
                f"of {reservation.served_model.name}.",
            )
            return redirect("planner:customers:detail", slug=customer.slug)
    context = detail_context(request, customer, reservation_form=form, problem=problem)
    return render(
        request,
        "planner/customers/detail.html",
        context,
        status=problem.status if problem else 400,
    )


def _reservation_of(customer: Customer, pk: int) -> Reservation:
    reservation = reservation_of_customer(customer, pk)
    if reservation is None:
        raise Http404("No such reservation for this customer.")
    return reservation


@planner_required
@require_POST
def reservation_amend_view(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    """Change a reservation's rate or end; the outcome is a message on the customer's page."""
    customer = get_object_or_404(Customer, slug=slug)
    reservation = _reservation_of(customer, pk)
    form = AmendForm(request.POST)
    if not form.is_valid():
        for field, errors in form.errors.items():
            messages.error(
                request, f"Reservation {pk}: {field}: {' '.join(str(error) for error in errors)}"
            )
        return redirect("planner:customers:detail", slug=customer.slug)
    try:
        reservation_amend(
            reservation=reservation,
            mu_per_minute=form.cleaned_data["mu_per_minute"],
            ends_at=form.cleaned_data["ends_at"],
            actor=_actor(request),
        )
    except DomainError as error:
        messages.error(request, f"Reservation {pk} was not amended: {error.message}")
    else:
        messages.success(request, f"Reservation {pk} amended.")
    return redirect("planner:customers:detail", slug=customer.slug)


@planner_required
@require_POST
def reservation_cancel_view(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    """Cancel a reservation; the outcome is a message on the customer's page."""
    customer = get_object_or_404(Customer, slug=slug)
    reservation = _reservation_of(customer, pk)
    try:
        reservation_cancel(reservation=reservation, actor=_actor(request))
    except DomainError as error:
        messages.error(request, f"Reservation {pk} was not cancelled: {error.message}")
    else:
        messages.success(request, f"Reservation {pk} cancelled.")
    return redirect("planner:customers:detail", slug=customer.slug)


@planner_required
@require_POST
def api_key_new(request: HttpRequest, slug: str) -> HttpResponse:
    """Create a key of the customer's; its plaintext is shown in this response only."""
    customer = get_object_or_404(Customer, slug=slug)
    form = ApiKeyForm(request.POST)
    if form.is_valid():
        try:
            created = api_key_create(
                customer=customer,
                created_by=request.user,
                actor=actor_of(user=request.user),
                **form.cleaned_data,
            )
        except DomainError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            # The plaintext is in this response only: it is not stored, not in the session,
            # and not shown again (the list shows the prefix).
            context = detail_context(request, customer, new_key=created)
            return render(request, "planner/customers/detail.html", context, status=201)
    context = detail_context(request, customer, key_form=form)
    return render(request, "planner/customers/detail.html", context, status=400)


@planner_required
@require_POST
def api_key_revoke_view(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    """Revoke one of the customer's keys: it no longer authenticates."""
    customer = get_object_or_404(Customer, slug=slug)
    api_key = api_key_of_customer(customer, pk)
    if api_key is None:
        raise Http404("No such key for this customer.")
    api_key_revoke(api_key=api_key, actor=actor_of(user=request.user))
    messages.success(request, f"Key {api_key.prefix} revoked: it no longer authenticates.")
    return redirect("planner:customers:detail", slug=customer.slug)


@planner_required
@require_POST
def membership_remove_view(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    """Remove a person from the customer, and the keys they made if the form says so."""
    customer = get_object_or_404(Customer, slug=slug)
    membership = membership_of_customer(customer, pk)
    if membership is None:
        raise Http404("No such person of this customer.")
    form = MembershipRemoveForm(request.POST)
    form.is_valid()  # a checkbox: always valid, absent is False
    removed = membership_remove(
        membership=membership,
        revoke_keys=form.cleaned_data["revoke_keys"],
        actor=actor_of(user=request.user),
    )
    messages.success(request, removed_message(removed, customer))
    return redirect("planner:customers:detail", slug=customer.slug)


@planner_required
@require_POST
def request_limit_set_view(request: HttpRequest, slug: str) -> HttpResponse:
    """Set the RPM, TPM and concurrency limits of the customer or of one of its keys."""
    customer = get_object_or_404(Customer, slug=slug)
    keys = _usable_keys(customer)
    form = RequestLimitForm(request.POST, keys=keys)
    if form.is_valid():
        data = form.cleaned_data
        api_key = next((key for key in keys if key.prefix == data["api_key"]), None)
        try:
            request_limit_set(
                customer=customer,
                api_key=api_key,
                requests_per_minute=data["requests_per_minute"],
                tokens_per_minute=data["tokens_per_minute"],
                concurrent_requests=data["concurrent_requests"],
                actor=actor_of(user=request.user),
            )
        except DomainError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            whose = f"key {api_key.prefix}" if api_key else "all its keys"
            messages.success(request, f"Request limits of {customer.name} ({whose}) saved.")
            return redirect("planner:customers:detail", slug=customer.slug)
    context = detail_context(request, customer, limit_form=form)
    return render(request, "planner/customers/detail.html", context, status=400)


@planner_required
@require_POST
def request_limit_delete_view(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    """Remove one of the customer's request limits."""
    customer = get_object_or_404(Customer, slug=slug)
    limit = RequestLimit.objects.filter(customer=customer, pk=pk).first()
    if limit is None:
        raise Http404("No such request limit for this customer.")
    request_limit_delete(limit=limit, actor=actor_of(user=request.user))
    messages.success(request, "Request limits removed.")
    return redirect("planner:customers:detail", slug=customer.slug)
