from rest_framework.permissions import SAFE_METHODS, BasePermission

from accounts.principals import principal_of


class IsPlanner(BasePermission):
    message = "Only planners may do this."

    def has_permission(self, request, view) -> bool:
        return principal_of(request).is_planner


class ReadScope(BasePermission):
    """Reading anything needs the `read` scope (planners have every scope). For endpoints that
    only read, whatever their method (e.g. an estimate posted as a body)."""

    message = "Reading this needs the read scope."

    def has_permission(self, request, view) -> bool:
        return principal_of(request).has_scope("read")


class CatalogPermission(BasePermission):
    """Anyone signed in reads the catalog; planners and `catalog:write` service keys change it."""

    message = "Only planners or a service key with the catalog:write scope may change the catalog."

    def has_permission(self, request, view) -> bool:
        principal = principal_of(request)
        if request.method in SAFE_METHODS:
            return principal.has_scope("read") or principal.is_planner
        return principal.is_planner or (
            principal.is_service and principal.has_scope("catalog:write")
        )
