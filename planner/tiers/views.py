"""Tiers: the planner defines them (name, weight, shed order). Each one's weight in the even
part of the best-effort split and its place in the order degradation sheds best-effort traffic;
writes go through accounts.services, audited, as the API's do."""

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from accounts.models import DEFAULT_TIER, Tier
from accounts.selectors import tiers_with_customer_counts
from accounts.services import tier_create, tier_delete, tier_update
from core.audit import actor_of
from core.errors import DomainError
from planner.access import planner_required
from planner.tiers.forms import TierChangeForm, TierForm


def _page(
    request: HttpRequest,
    *,
    form: TierForm | None = None,
    editing: str | None = None,
    edit_form: TierChangeForm | None = None,
    status: int = 200,
) -> HttpResponse:
    tiers = tiers_with_customer_counts()
    # For the template only: each row's default mark and its change form.
    for tier in tiers:
        tier.is_default = tier.name == DEFAULT_TIER
        tier.change_form = (
            edit_form
            if editing == tier.name
            else TierChangeForm(
                initial={"label": tier.label, "weight": tier.weight, "shed_order": tier.shed_order},
                prefix=tier.name,
            )
        )
    next_order = max((tier.shed_order for tier in tiers), default=0) + 1
    context = {
        "tiers": tiers,
        "form": form or TierForm(initial={"weight": 1.0, "shed_order": next_order}),
        "default_tier": DEFAULT_TIER,
    }
    return render(request, "planner/tiers/list.html", context, status=status)


@planner_required
def tier_list(request: HttpRequest) -> HttpResponse:
    """The tiers, each with its change form; POST creates one."""
    if request.method != "POST":
        return _page(request)
    form = TierForm(request.POST)
    if form.is_valid():
        try:
            tier = tier_create(actor=actor_of(user=request.user), **form.cleaned_data)
        except DomainError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
            return _page(request, form=form, status=error.status)
        messages.success(request, f"Tier {tier.name} created.")
        return redirect("planner:tiers:list")
    return _page(request, form=form, status=400)


@planner_required
@require_POST
def tier_change(request: HttpRequest, name: str) -> HttpResponse:
    """Save a tier's label, weight and shed order."""
    tier = get_object_or_404(Tier, name=name)
    form = TierChangeForm(request.POST, prefix=tier.name)
    if form.is_valid():
        try:
            tier_update(tier=tier, changes=form.cleaned_data, actor=actor_of(user=request.user))
        except DomainError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
            return _page(request, editing=tier.name, edit_form=form, status=error.status)
        messages.success(request, f"Tier {tier.name} saved.")
        return redirect("planner:tiers:list")
    return _page(request, editing=tier.name, edit_form=form, status=400)


@planner_required
@require_POST
def tier_delete_view(request: HttpRequest, name: str) -> HttpResponse:
    """Delete a tier; the service refuses one that is in use or the default."""
    tier = get_object_or_404(Tier, name=name)
    try:
        tier_delete(tier=tier, actor=actor_of(user=request.user))
    except DomainError as error:
        messages.error(request, f"Tier {name} was not deleted: {error.message}")
    else:
        messages.success(request, f"Tier {name} deleted.")
    return redirect("planner:tiers:list")
