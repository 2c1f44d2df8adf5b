"""Reads for customers and API keys, always through what the principal may see."""

from django.db.models import Q, QuerySet

from accounts import scopes as S
from accounts.models import ApiKey, Customer, Membership
from accounts.principals import Principal


def customers_visible_to(principal: Principal) -> QuerySet[Customer]:
    # The tier is read by name through its row (a to_field key): fetched with the customers,
    # not once per customer.
    customers = Customer.objects.select_related("tier")
    if principal.sees_all_customers:
        return customers
    return customers.filter(pk__in=principal.customer_ids)


def api_keys_visible_to(principal: Principal) -> QuerySet[ApiKey]:
    api_keys = ApiKey.objects.select_related("customer")
    if principal.is_planner:
        return api_keys
    if principal.is_service:
        # A service sees its own key and, when it provisions customers, customers' keys.
        if S.CUSTOMERS_WRITE in principal.scopes:
            return api_keys.filter(customer__isnull=False) | api_keys.filter(
                pk=principal.api_key.pk
            )
        return api_keys.filter(pk=principal.api_key.pk)
    return api_keys.filter(customer_id__in=principal.customer_ids)


# --- The planner's customer pages (planners see every customer) ------------------------------


def customers_by_slug(*, text: str = "") -> QuerySet[Customer]:
    """Customers by slug, narrowed to those whose slug or name contains the text when given."""
    customers = Customer.objects.select_related("tier").order_by("slug")
    if text:
        customers = customers.filter(Q(slug__icontains=text) | Q(name__icontains=text))
    return customers


def any_customers() -> bool:
    return Customer.objects.exists()


def api_keys_of_customer_newest_first(customer: Customer) -> QuerySet[ApiKey]:
    return customer.api_keys.order_by("-created_at", "-id")


def api_key_ids_of_customer(customer: Customer) -> QuerySet:
    return customer.api_keys.values_list("pk", flat=True)


def membership_ids_of_customer(customer: Customer) -> QuerySet:
    return customer.memberships.values_list("pk", flat=True)


def api_key_of_customer(customer: Customer, pk: int) -> ApiKey | None:
    """The customer's key with this id; None when it has none (or it is another's)."""
    return ApiKey.objects.filter(customer=customer, pk=pk).first()


# --- The customer portal (a user sees the customers it is a member of, nothing else) --------


def memberships_of_user(user) -> QuerySet[Membership]:
    """The user's memberships with their customers, by customer slug."""
    return (
        Membership.objects.filter(user=user).select_related("customer").order_by("customer__slug")
    )


def membership_of_user(user, slug: str) -> Membership | None:
    """The user's membership of the customer with this slug; None when it is not a member
    (or no such customer exists: the portal answers both alike, 404)."""
    return (
        Membership.objects.filter(user=user, customer__slug=slug).select_related("customer").first()
    )


def tiers_with_customer_counts() -> list:
    """Every tier in shed order, each with `customer_count` (one grouped query)."""
    from django.db.models import Count

    from accounts.models import Tier

    return list(Tier.objects.annotate(customer_count=Count("customers")).order_by("shed_order"))
