from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts import selectors, services
from accounts.api.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeySerializer,
    CustomerSerializer,
    MeSerializer,
    TierChangeSerializer,
    TierSerializer,
)
from accounts.models import ApiKey, Customer, Tier
from accounts.permissions import scoped_permission
from accounts.principals import principal_of
from core.api.mixins import AuditedPatchMixin
from core.audit import actor_of

CustomerPermission = scoped_permission(
    "CustomerPermission",
    message="Only planners or a service key with the customers:write scope manage customers.",
    write_scope=S.CUSTOMERS_WRITE,
)


class ApiKeyPermission(BasePermission):
    """Listing and reading keys needs the read scope; creating and revoking are checked by the
    view against the key's customer."""

    message = "Reading API keys needs the read scope."

    def has_permission(self, request, view) -> bool:
        principal = principal_of(request)
        if request.method in SAFE_METHODS:
            return principal.has_scope(S.READ)
        return bool(request.user and request.user.is_authenticated)


_KEY_MANAGERS = (
    "You may not {verb} keys of this customer: its owners manage its keys (members and viewers "
    "read), and a key with the write scope does so only while the person who made it is one "
    "of its owners."
)


class CustomerFilter(filters.FilterSet):
    class Meta:
        model = Customer
        fields = {"tier": ["exact"], "slug": ["exact"], "created_at": ["gte", "lte"]}


class CustomerViewSet(viewsets.ModelViewSet):
    """Customers (tenants). Planners manage them; a customer sees only itself."""

    serializer_class = CustomerSerializer
    permission_classes = [CustomerPermission]
    lookup_field = "slug"
    filterset_class = CustomerFilter
    search_fields = ["name", "slug"]
    ordering_fields = ["slug", "name", "created_at"]

    def get_queryset(self):
        return selectors.customers_visible_to(principal_of(self.request))

    def perform_create(self, serializer):
        serializer.instance = services.customer_create(**serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = services.customer_update(
            customer=serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance):
        services.customer_delete(customer=instance)


class ApiKeyFilter(filters.FilterSet):
    customer = filters.CharFilter(field_name="customer__slug")
    revoked = filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = ApiKey
        fields = ["customer", "service_name", "revoked"]


class ApiKeyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    viewsets.GenericViewSet,
):
    """API keys. The secret is returned once, by create, and never again.

    Planners manage every key. A customer's people list its keys; its owners (and its keys
    with the `write` scope, while the person who made them is one of its owners) create and
    revoke them, as in the portal: members and viewers read (accounts.scopes.ROLE_SCOPES).
    """

    serializer_class = ApiKeySerializer
    permission_classes = [ApiKeyPermission]
    filterset_class = ApiKeyFilter
    search_fields = ["name", "prefix", "service_name"]
    ordering_fields = ["created_at", "last_used_at", "name"]

    def get_queryset(self):
        return selectors.api_keys_visible_to(principal_of(self.request))

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer})
    def create(self, request, *args, **kwargs):
        principal = principal_of(request)
        # Who may create keys at all is known before the body is read: a caller that may not
        # gets 403 whatever it sends, rather than the body's 400.
        if principal.is_service:
            may_create = principal.has_scope(S.CUSTOMERS_WRITE)
        else:
            may_create = principal.has_scope(S.WRITE)
        if not may_create:
            raise PermissionDenied(
                "Creating keys needs the write scope (customers:write for platform keys); "
                "signed in, a customer's owners create its keys, members and viewers read."
            )
        customers = (
            Customer.objects.all()
            if principal.is_planner
            or (principal.is_service and principal.has_scope(S.CUSTOMERS_WRITE))
            else selectors.customers_visible_to(principal)
        )
        # Another tenant's slug reads exactly like an unknown one (the serializer's 400).
        serializer = ApiKeyCreateSerializer(data=request.data, customers=customers)
        serializer.is_valid(raise_exception=True)
        customer = serializer.validated_data.get("customer")
        if customer is not None:
            if not principal.can_manage_customer_keys(customer.pk):
                raise PermissionDenied(_KEY_MANAGERS.format(verb="create"))
        elif not principal.is_planner:
            raise PermissionDenied("Only planners create service keys.")
        created = services.api_key_create(
            name=serializer.validated_data["name"],
            customer=customer,
            service_name=serializer.validated_data.get("service_name", ""),
            scopes=serializer.validated_data.get("scopes"),
            expires_at=serializer.expires_at(),
            created_by=request.user if getattr(request.user, "pk", None) else None,
            created_by_key=principal.api_key,
            actor=actor_of(principal),
        )
        body = ApiKeySerializer(created.api_key).data | {"key": created.plaintext}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        api_key = self.get_object()
        principal = principal_of(request)
        allowed = (
            principal.is_planner
            or (principal.api_key is not None and principal.api_key.pk == api_key.pk)
            or (api_key.customer_id and principal.can_manage_customer_keys(api_key.customer_id))
        )
        if not allowed:
            raise PermissionDenied(_KEY_MANAGERS.format(verb="revoke"))
        services.api_key_revoke(api_key=api_key, actor=actor_of(principal))
        return Response(ApiKeySerializer(api_key).data)


class MeView(APIView):
    """Who the caller is, and what it may see."""

    @extend_schema(responses=MeSerializer)
    def get(self, request):
        principal = principal_of(request)
        if principal.api_key is not None:
            key = principal.api_key
            customers = [{"customer": key.customer.slug, "role": "key"}] if key.customer_id else []
            body: dict[str, object] = {
                "kind": "api_key",
                "username": None,
                "api_key_prefix": key.prefix,
                "service_name": key.service_name,
            }
        else:
            customers = [
                {"customer": slug, "role": role}
                for slug, role in request.user.memberships.values_list("customer__slug", "role")
            ]
            body = {
                "kind": "user",
                "username": request.user.get_username(),
                "api_key_prefix": None,
                "service_name": "",
            }
        body |= {
            "is_planner": principal.is_planner,
            "is_service": principal.is_service,
            "scopes": sorted(principal.scopes),
            "customers": customers,
        }
        return Response(MeSerializer(body).data)


TierPermission = scoped_permission(
    "TierPermission",
    message="Only planners define tiers.",
    write_scope=None,
)


class TierViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    AuditedPatchMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Customer tiers, in shed order: each one's weight in the even part of the best-effort
    split and its place in the order degradation sheds best-effort traffic (the lowest first).
    Everyone signed in reads them; planners define them (audited). A tier's name is fixed once
    made (customers refer to it); a tier with customers, and the default tier, cannot be
    deleted (409)."""

    serializer_class = TierSerializer
    change_serializer_class = TierChangeSerializer
    put_refused_message = "Change a tier with PATCH."
    permission_classes = [TierPermission]
    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    queryset = Tier.objects.order_by("shed_order")

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = services.tier_create(
            name=data["name"],
            label=data.get("label", ""),
            weight=data.get("weight", 1.0),
            shed_order=data["shed_order"],
            actor=actor_of(principal_of(self.request)),
        )

    def perform_audited_update(self, instance, *, changes):
        return services.tier_update(
            tier=instance, changes=changes, actor=actor_of(principal_of(self.request))
        )

    def perform_destroy(self, instance):
        services.tier_delete(tier=instance, actor=actor_of(principal_of(self.request)))
