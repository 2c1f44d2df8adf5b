"""Reads for customers and API keys, always through what the principal may see."""

from django.db.models import Case, Count, IntegerField, Q, QuerySet, Value, When

from accounts import scopes as S
from accounts.models import ApiKey, Customer, Membership, Tier
from accounts.principals import Principal


def customers_visible_to(principal: Principal) -> QuerySet[Customer]:
    """The customers a caller may see: every one for planners and services that see all,
    else only those it belongs to. Every customer list of the API starts here."""
    # The tier is read by name through its row (a to_field key): fetched with the customers,
    # not once per customer.
    customers = Customer.objects.select_related("tier")
    if principal.sees_all_customers:
        return customers
    return customers.filter(pk__in=principal.customer_ids)


def api_keys_visible_to(principal: Principal) -> QuerySet[ApiKey]:
    """The keys a caller may see: all for planners; a service's own (and customers' keys when
    it provisions customers); a customer's member, its customers' keys."""
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
    """Whether any customer exists: the planner's list says "none yet" rather than "no match"."""
    return Customer.objects.exists()


def api_keys_of_customer_newest_first(customer: Customer) -> QuerySet[ApiKey]:
    """The customer's keys, revoked ones included, newest first (the order the pages list)."""
    return customer.api_keys.order_by("-created_at", "-id")


def api_key_ids_of_customer(customer: Customer) -> QuerySet:
    """The ids of the customer's keys, as a subquery: the customer's history shows their audit
    entries too."""
    return customer.api_keys.values_list("pk", flat=True)


def membership_ids_of_customer(customer: Customer) -> QuerySet:
    """The ids of the customer's memberships, as a subquery: likewise for its people."""
    return customer.memberships.values_list("pk", flat=True)


def api_key_of_customer(customer: Customer, pk: int) -> ApiKey | None:
    """The customer's key with this id; None when it has none (or it is another's)."""
    return ApiKey.objects.filter(customer=customer, pk=pk).first()


# --- A customer's people, and the keys each made ----------------------------------------------


def people_of_customer(customer: Customer) -> QuerySet[Membership]:
    """The customer's memberships with their users, owners first, then by username."""
    role_order = Case(
        *(When(role=role, then=Value(rank)) for rank, role in enumerate(Membership.Role.values)),
        output_field=IntegerField(),
    )
    return (
        customer.memberships.select_related("user")
        .annotate(role_rank=role_order)
        .order_by("role_rank", "user__username", "pk")
    )


def membership_of_customer(customer: Customer, pk: int) -> Membership | None:
    """The customer's membership with this id; None when it has none (or it is another's)."""
    return Membership.objects.filter(customer=customer, pk=pk).select_related("user").first()


def live_api_keys_made_by(customer: Customer, user_ids) -> dict[int, list[ApiKey]]:
    """user id → the customer's unrevoked keys that person made, oldest first: the keys they
    created, and the keys those keys created (a key made by a key is its maker's too, revoked
    or not in between). What removing the person from the customer offers to revoke.

    One query per generation of keys making keys (usually one or two), whatever the number of
    people or keys."""
    user_ids = list(user_ids)
    made: dict[int, list[ApiKey]] = {user_id: [] for user_id in user_ids}
    if not user_ids:
        return made
    keys = ApiKey.objects.filter(customer=customer).order_by("created_at", "pk")
    maker_of: dict[int, int] = {}  # key id → the person behind it
    generation = list(keys.filter(created_by_id__in=user_ids))
    while generation:
        for key in generation:
            maker = (
                key.created_by_id if key.created_by_id in made else maker_of[key.created_by_key_id]
            )
            maker_of[key.pk] = maker
            if key.revoked_at is None:
                made[maker].append(key)
        # Keys made by this generation's keys and not reached yet (nothing repeats: a key is
        # made after the key that made it).
        generation = list(
            keys.filter(created_by_key_id__in=[key.pk for key in generation]).exclude(
                pk__in=list(maker_of)
            )
        )
    for user_keys in made.values():
        user_keys.sort(key=lambda key: (key.created_at, key.pk))
    return made


def service_keys_by_gateway_access(*, now) -> tuple[list[ApiKey], list[ApiKey]]:
    """The platform's live (unrevoked, unexpired) service keys: (those holding `admission`,
    which a gateway lets send requests, those without it, which it refuses), each by service
    name then prefix."""
    live = [
        key
        for key in ApiKey.objects.filter(customer__isnull=True, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("service_name", "prefix")
    ]
    # Scopes are a JSON list: filtered here, as containment on JSON differs between the
    # databases the project runs on.
    return (
        [key for key in live if S.ADMISSION in key.scopes],
        [key for key in live if S.ADMISSION not in key.scopes],
    )


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
    return list(Tier.objects.annotate(customer_count=Count("customers")).order_by("shed_order"))
