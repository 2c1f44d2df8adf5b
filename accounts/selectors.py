"""Reads for customers and API keys, always through what the principal may see."""

from django.db.models import QuerySet

from accounts.models import ApiKey, Customer
from accounts.principals import Principal


def customers_visible_to(principal: Principal) -> QuerySet[Customer]:
    customers = Customer.objects.all()
    if principal.sees_all_customers:
        return customers
    return customers.filter(pk__in=principal.customer_ids)


def api_keys_visible_to(principal: Principal) -> QuerySet[ApiKey]:
    api_keys = ApiKey.objects.select_related("customer")
    if principal.is_planner:
        return api_keys
    if principal.is_service:
        # A service sees its own key and, when it provisions customers, customers' keys.
        if "customers:write" in principal.scopes:
            return api_keys.filter(customer__isnull=False) | api_keys.filter(
                pk=principal.api_key.pk
            )
        return api_keys.filter(pk=principal.api_key.pk)
    return api_keys.filter(customer_id__in=principal.customer_ids)
