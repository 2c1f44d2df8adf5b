"""Who is asking: one view of a request's caller, whether a user session or an API key.

Planners (staff users in the `planners` group, or superusers) see and manage everything.
A customer's member or key sees only that customer. A platform service key acts across
customers, limited by its scopes.
"""

from dataclasses import dataclass, field

from django.contrib.auth.models import AnonymousUser

from accounts import scopes as S
from accounts.models import ApiKey, Membership

PLANNERS_GROUP = "planners"


def user_is_planner(user) -> bool:
    """An active superuser, or an active staff user in the planners group: staff alone is not
    enough, so an admin account made for another purpose plans nothing."""
    if not getattr(user, "is_authenticated", False) or not getattr(user, "is_active", False):
        return False
    if user.is_superuser:
        return True
    return user.is_staff and user.groups.filter(name=PLANNERS_GROUP).exists()


@dataclass(frozen=True)
class Principal:
    """A caller as the permission rules see it: planner, platform service or a customer's
    (member or key), with its scopes and its role in each customer it belongs to."""

    is_planner: bool = False
    is_service: bool = False
    # Customer id → role for users; a customer key has its one customer with the "key" role.
    roles: dict[int, str] = field(default_factory=dict)
    scopes: frozenset[str] = frozenset()
    api_key: ApiKey | None = None
    user: object | None = None

    @property
    def sees_all_customers(self) -> bool:
        """Planners, and services holding `read`, see every customer."""
        return self.is_planner or (self.is_service and S.READ in self.scopes)

    @property
    def customer_ids(self) -> set[int]:
        """The customers the caller belongs to (none for planners and services)."""
        return set(self.roles)

    def can_see_customer(self, customer_id: int) -> bool:
        """Whether the caller may read this customer's objects."""
        return self.sees_all_customers or customer_id in self.roles

    def has_scope(self, scope: str) -> bool:
        """Whether the caller holds the scope; planners hold every one."""
        return self.is_planner or scope in self.scopes

    def can_manage_customer_keys(self, customer_id: int) -> bool:
        """Create or revoke the customer's own keys: its owners (accounts.scopes.ROLE_SCOPES,
        the rule the portal follows too), and its keys with `write` while the person who made
        them may (key_maker_manages_keys)."""
        if self.is_planner:
            return True
        if self.is_service:
            return S.CUSTOMERS_WRITE in self.scopes
        role = self.roles.get(customer_id)
        if role is None:
            return False
        if self.api_key is not None:
            return S.WRITE in self.scopes and key_maker_manages_keys(self.api_key)
        return S.role_manages_keys(role)


ANONYMOUS = Principal()


def principal_for_user(user) -> Principal:
    """A signed-in user's principal: a planner, or a person with a role in each customer they
    belong to and the union of those roles' scopes; anyone else is ANONYMOUS."""
    if user is None or isinstance(user, AnonymousUser) or not user.is_authenticated:
        return ANONYMOUS
    if user_is_planner(user):
        return Principal(is_planner=True, scopes=frozenset(S.ALL_SCOPES), user=user)
    roles = dict(user.memberships.values_list("customer_id", "role"))
    # What the person may do anywhere; can_manage_customer_keys narrows it per customer (an
    # owner of one customer and a member of another manages only the first's keys).
    scopes = frozenset({S.READ}).union(*(S.ROLE_SCOPES.get(role, ()) for role in roles.values()))
    return Principal(roles=roles, scopes=scopes, user=user)


def key_maker_manages_keys(api_key: ApiKey) -> bool:
    """Whether a customer key's `write` still counts for managing the customer's keys: a key
    acts for the person who made it (or made the key that made it, and so on), never beyond
    that person's role in the customer now. A key a member made before members lost key
    management, or a key of an owner since made a member, holds `write` but manages no keys.

    A key no person of the customer's made (a planner's, a command's, a provisioning
    service's, or one kept when its maker was removed from the customer) answers to the
    platform, not to a role: its scopes alone decide. Costs a query or two, on key writes only.
    """
    key: ApiKey | None = api_key
    seen: set[int] = set()
    while key is not None and key.pk not in seen:
        seen.add(key.pk)
        if key.created_by_id is not None:
            role = (
                Membership.objects.filter(
                    user_id=key.created_by_id, customer_id=api_key.customer_id
                )
                .values_list("role", flat=True)
                .first()
            )
            return role is None or S.role_manages_keys(role)
        if key.created_by_key_id is None:
            return True
        key = (
            ApiKey.objects.only("pk", "created_by", "created_by_key")
            .filter(pk=key.created_by_key_id)
            .first()
        )
    return True


def principal_for_key(api_key: ApiKey) -> Principal:
    """An API key's principal: a customer key acts for its one customer, a service key across
    customers; either does no more than its scopes say."""
    if api_key.customer_id:
        return Principal(
            roles={api_key.customer_id: "key"},
            scopes=frozenset(api_key.scopes),
            api_key=api_key,
        )
    return Principal(is_service=True, scopes=frozenset(api_key.scopes), api_key=api_key)


def principal_of(request) -> Principal:
    """The principal of a DRF request, computed once and kept on the request."""
    cached = getattr(request, "_principal", None)
    if cached is not None:
        return cached
    auth = getattr(request, "auth", None)
    principal = (
        principal_for_key(auth) if isinstance(auth, ApiKey) else principal_for_user(request.user)
    )
    request._principal = principal
    return principal
