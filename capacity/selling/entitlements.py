"""Entitlements: the served models a customer's keys may use (issue 18).

A planner (or a provisioning service with customers:write) sets a customer's whole list, or
grants and withdraws one model. Every change is audited as the list before → after, and
published to gateways after commit (`gw:v1:entitlements`, capacity.publication). Gateways
refuse a customer key a model outside its customer's list; service keys are not limited.
"""

from __future__ import annotations

from django.db import transaction

from accounts.models import Customer
from capacity.hooks import gateway_state_changed
from capacity.models import Entitlement, ServedModel
from core.audit import audit_change, current_actor


def entitled_model_names(customer: Customer) -> list[str]:
    """The names of the models the customer may use, sorted."""
    return list(
        Entitlement.objects.filter(customer=customer)
        .order_by("served_model__name")
        .values_list("served_model__name", flat=True)
    )


def _locked(customer: Customer) -> Customer:
    # One writer of a customer's list at a time, so "before" in the audit entry is true.
    return Customer.objects.select_for_update().get(pk=customer.pk)


def _record(customer: Customer, before: list[str], actor: str | None) -> None:
    after = entitled_model_names(customer)
    if audit_change(
        action="customer.entitlements",
        obj=customer,
        before={"models": before},
        after={"models": after},
        actor=actor,
    ):
        gateway_state_changed("entitlements changed")


@transaction.atomic
def entitlements_set(
    *, customer: Customer, served_models: list[ServedModel], actor: str | None = None
) -> list[str]:
    """Make the customer's list exactly `served_models`; returns the names now allowed."""
    customer = _locked(customer)
    before = entitled_model_names(customer)
    wanted = {model.pk for model in served_models}
    Entitlement.objects.filter(customer=customer).exclude(served_model_id__in=wanted).delete()
    held = set(
        Entitlement.objects.filter(customer=customer).values_list("served_model_id", flat=True)
    )
    granted_by = (actor or current_actor())[:200]
    Entitlement.objects.bulk_create(
        [
            Entitlement(customer=customer, served_model_id=pk, granted_by=granted_by)
            for pk in sorted(wanted - held)
        ]
    )
    _record(customer, before, actor)
    return entitled_model_names(customer)


@transaction.atomic
def entitlement_grant(
    *, customer: Customer, served_model: ServedModel, actor: str | None = None
) -> list[str]:
    """Allow one more model (granting one already allowed changes nothing)."""
    customer = _locked(customer)
    before = entitled_model_names(customer)
    Entitlement.objects.get_or_create(
        customer=customer,
        served_model=served_model,
        defaults={"granted_by": (actor or current_actor())[:200]},
    )
    _record(customer, before, actor)
    return entitled_model_names(customer)


@transaction.atomic
def entitlement_withdraw(
    *, customer: Customer, served_model: ServedModel, actor: str | None = None
) -> list[str]:
    """Withdraw one model (withdrawing one not allowed changes nothing)."""
    customer = _locked(customer)
    before = entitled_model_names(customer)
    Entitlement.objects.filter(customer=customer, served_model=served_model).delete()
    _record(customer, before, actor)
    return entitled_model_names(customer)
