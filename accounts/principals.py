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
    if not getattr(user, "is_authenticated", False) or not getattr(user, "is_active", False):
        return False
    if user.is_superuser:
        return True
    return user.is_staff and user.groups.filter(name=PLANNERS_GROUP).exists()


@dataclass(frozen=True)
class Principal:
    is_planner: bool = False
    is_service: bool = False
    # Customer id → role for users; a customer key has its one customer with the "key" role.
    roles: dict[int, str] = field(default_factory=dict)
    scopes: frozenset[str] = frozenset()
    api_key: ApiKey | None = None
    user: object | None = None

    @property
    def sees_all_customers(self) -> bool:
        return self.is_planner or (self.is_service and S.READ in self.scopes)

    @property
    def customer_ids(self) -> set[int]:
        return set(self.roles)

    def can_see_customer(self, customer_id: int) -> bool:
        return self.sees_all_customers or customer_id in self.roles

    def has_scope(self, scope: str) -> bool:
        return self.is_planner or scope in self.scopes

    def can_manage_customer_keys(self, customer_id: int) -> bool:
        """Create or revoke the customer's own keys."""
        if self.is_planner:
            return True
        if self.is_service:
            return S.CUSTOMERS_WRITE in self.scopes
        role = self.roles.get(customer_id)
        if self.api_key is not None:
            return role is not None and S.WRITE in self.scopes
        return role in {Membership.Role.OWNER, Membership.Role.MEMBER}


ANONYMOUS = Principal()


def principal_for_user(user) -> Principal:
    if user is None or isinstance(user, AnonymousUser) or not user.is_authenticated:
        return ANONYMOUS
    if user_is_planner(user):
        return Principal(is_planner=True, scopes=frozenset(S.ALL_SCOPES), user=user)
    roles = dict(user.memberships.values_list("customer_id", "role"))
    scopes = {S.READ}
    if any(role != Membership.Role.VIEWER for role in roles.values()):
        scopes.add(S.WRITE)
    return Principal(roles=roles, scopes=frozenset(scopes), user=user)


def principal_for_key(api_key: ApiKey) -> Principal:
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
