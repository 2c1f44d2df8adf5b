from rest_framework.permissions import SAFE_METHODS, BasePermission

from accounts import scopes as S
from accounts.principals import Principal, principal_of

# Who may read: anyone whose key has the read scope (customers too; the views then narrow
# what they see to their own), or only the operator's side (planners and service keys).
ANYONE_WITH_READ = "anyone"
OPERATORS = "operators"


def _reads(principal: Principal, readers: str) -> bool:
    if readers == OPERATORS:
        return principal.is_planner or (principal.is_service and principal.has_scope(S.READ))
    return principal.has_scope(S.READ)


def scoped_permission(
    name: str, *, message: str, write_scope: str | None, readers: str = ANYONE_WITH_READ
) -> type[BasePermission]:
    """The house's one permission rule: reads by `readers`; writes by planners, and by service
    keys holding `write_scope` (None: planners only). Customer keys never write through it."""

    def has_permission(self, request, view) -> bool:
        principal = principal_of(request)
        if request.method in SAFE_METHODS:
            return _reads(principal, readers)
        return principal.is_planner or (
            write_scope is not None and principal.is_service and principal.has_scope(write_scope)
        )

    return type(name, (BasePermission,), {"message": message, "has_permission": has_permission})


class IsPlanner(BasePermission):
    message = "Only planners may do this."

    def has_permission(self, request, view) -> bool:
        return principal_of(request).is_planner


class ReadScope(BasePermission):
    """Reading anything needs the `read` scope (planners have every scope). For endpoints that
    only read, whatever their method (e.g. an estimate posted as a body)."""

    message = "Reading this needs the read scope."

    def has_permission(self, request, view) -> bool:
        return principal_of(request).has_scope(S.READ)


CatalogPermission = scoped_permission(
    "CatalogPermission",
    message="Only planners or a service key with the catalog:write scope may change the catalog.",
    write_scope=S.CATALOG_WRITE,
)
