from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.models import Customer
from accounts.permissions import scoped_permission
from accounts.principals import principal_of
from accounts.selectors import customers_visible_to
from capacity.models import Reservation, ReservationChange, ServedModel
from capacity.selling import entitlements, reservations
from capacity.selling.selectors import is_at_risk
from core.api.serializers import (
    FreeTextField,
    InstantField,
    StrictModelSerializer,
    StrictSerializer,
    no_control_characters,
)
from core.audit import actor_of

ReservationPermission = scoped_permission(
    "ReservationPermission",
    message="Selling capacity needs a planner or a key with the reservations:write scope.",
    write_scope=S.RESERVATIONS_WRITE,
)


class ReservationSerializer(StrictModelSerializer):
    customer = serializers.SlugRelatedField(slug_field="slug", queryset=Customer.objects.all())
    model = serializers.SlugRelatedField(
        source="served_model", slug_field="name", queryset=ServedModel.objects.all()
    )
    mu_per_minute = serializers.FloatField(min_value=0.000001, max_value=1e12)
    starts_at = InstantField(
        required=False,
        help_text="Default: now. At most RESERVATION_START_WINDOW_DAYS (365) from now.",
    )
    ends_at = InstantField(
        required=False,
        allow_null=True,
        help_text="Empty: open-ended. At most RESERVATION_MAX_TERM_DAYS (3650) after starts_at.",
    )
    notes = FreeTextField()
    at_risk = serializers.SerializerMethodField(
        help_text=(
            "True while the fleet cannot serve what is sold of the model at a moment of this "
            "reservation's term (its model is oversold: a pool shrank, a deployment went...)."
        )
    )

    class Meta:
        model = Reservation
        fields = [
            "id",
            "customer",
            "model",
            "mu_per_minute",
            "starts_at",
            "ends_at",
            "status",
            "keep_warm",
            "notes",
            "created_at",
            "updated_at",
            "cancelled_at",
            "at_risk",
        ]
        read_only_fields = ["id", "status", "created_at", "updated_at", "cancelled_at"]

    def get_at_risk(self, reservation: Reservation) -> bool:
        risk = getattr(reservation.served_model, "capacity_risk", None)
        return is_at_risk(reservation, risk)


class ReservationAmendSerializer(StrictSerializer):
    unknown_field_message = "cannot be amended; cancel and sell a new reservation."

    mu_per_minute = serializers.FloatField(min_value=0.000001, max_value=1e12, required=False)
    ends_at = InstantField(required=False, allow_null=True)
    keep_warm = serializers.BooleanField(required=False)
    notes = FreeTextField()


class ReservationChangeSerializer(serializers.ModelSerializer):
    class Meta:
        model = ReservationChange
        fields = ["kind", "changes", "changed_by", "changed_at"]


class ReservationFilter(filters.FilterSet):
    customer = filters.CharFilter(field_name="customer__slug")
    model = filters.CharFilter(field_name="served_model__name")

    class Meta:
        model = Reservation
        fields = ["customer", "model", "status", "keep_warm"]


def _actor(request) -> str:
    principal = principal_of(request)
    if principal.api_key is not None:
        return f"api-key:{principal.api_key.prefix}"
    return f"user:{request.user.get_username()}"


class ReservationViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """Sold capacity. A sale that the fleet cannot serve at every moment of its term is
    refused with 409 and the numbers: requested, sellable, already sold, shortfall."""

    serializer_class = ReservationSerializer
    permission_classes = [ReservationPermission]
    filterset_class = ReservationFilter
    ordering_fields = ["starts_at", "created_at", "mu_per_minute"]
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_queryset(self):
        principal = principal_of(self.request)
        queryset = Reservation.objects.select_related(
            "customer", "served_model", "served_model__capacity_risk"
        )
        if principal.sees_all_customers:
            return queryset
        return queryset.filter(customer_id__in=principal.customer_ids)

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = reservations.reservation_create(
            customer=data["customer"],
            served_model=data["served_model"],
            mu_per_minute=data["mu_per_minute"],
            starts_at=data.get("starts_at"),
            ends_at=data.get("ends_at"),
            keep_warm=data.get("keep_warm", False),
            notes=data.get("notes", ""),
            actor=_actor(self.request),
        )

    @extend_schema(request=ReservationAmendSerializer, responses=ReservationSerializer)
    def partial_update(self, request, *args, **kwargs):
        reservation = self.get_object()
        serializer = ReservationAmendSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        changes = dict(serializer.validated_data)
        amended = reservations.reservation_amend(
            reservation=reservation, actor=_actor(request), **changes
        )
        return Response(ReservationSerializer(amended).data)

    def update(self, request, *args, **kwargs):
        if not kwargs.get("partial"):
            raise PermissionDenied("Amend with PATCH.")
        return super().update(request, *args, **kwargs)

    @extend_schema(request=None, responses=ReservationSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        cancelled = reservations.reservation_cancel(
            reservation=self.get_object(), actor=_actor(request)
        )
        return Response(ReservationSerializer(cancelled).data, status=status.HTTP_200_OK)

    @extend_schema(responses=ReservationChangeSerializer(many=True))
    @action(detail=True, methods=["get"])
    def history(self, request, pk=None):
        reservation = self.get_object()
        return Response(ReservationChangeSerializer(reservation.changes.all(), many=True).data)

    def get_object(self):
        try:
            return super().get_object()
        except NotFound:
            raise NotFound("No such reservation.") from None


# --- Entitlements: the models a customer's keys may use ----------------------------------------

EntitlementPermission = scoped_permission(
    "EntitlementPermission",
    message="Only planners or a service key with the customers:write scope set entitlements.",
    write_scope=S.CUSTOMERS_WRITE,
)
MAX_ENTITLED_MODELS = 1000


class EntitlementsSerializer(StrictSerializer):
    customer = serializers.CharField(read_only=True, help_text="The customer's slug.")
    models = serializers.ListField(
        child=serializers.CharField(max_length=100, validators=[no_control_characters]),
        max_length=MAX_ENTITLED_MODELS,
        help_text="Names of the served models the customer's keys may use; [] for none. "
        "Service keys are not limited by it.",
    )

    def validate_models(self, names: list[str]) -> list[ServedModel]:
        found = {model.name: model for model in ServedModel.objects.filter(name__in=set(names))}
        unknown = sorted(set(names) - set(found))
        if unknown:
            raise serializers.ValidationError(
                f"No model named {', '.join(repr(name) for name in unknown)}."
            )
        return list(found.values())


class CustomerEntitlementsView(APIView):
    """The served models a customer's keys may use through a gateway (an allow-list: a model
    not listed is refused). Customers read their own; planners and provisioning services
    (customers:write) replace the list with PUT. Published to gateways after every change."""

    permission_classes = [EntitlementPermission]

    def _customer(self, request, slug: str) -> Customer:
        principal = principal_of(request)
        if request.method in ("GET", "HEAD", "OPTIONS"):
            customers = customers_visible_to(principal)
        else:
            # Writers provision every customer, whether or not their key may read them.
            customers = Customer.objects.all()
        customer = customers.filter(slug=slug).first()
        if customer is None:
            raise NotFound("No such customer.")
        return customer

    @extend_schema(responses=EntitlementsSerializer)
    def get(self, request, slug):
        customer = self._customer(request, slug)
        return Response(
            {"customer": customer.slug, "models": entitlements.entitled_model_names(customer)}
        )

    @extend_schema(request=EntitlementsSerializer, responses=EntitlementsSerializer)
    def put(self, request, slug):
        customer = self._customer(request, slug)
        serializer = EntitlementsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        names = entitlements.entitlements_set(
            customer=customer,
            served_models=serializer.validated_data["models"],
            actor=actor_of(principal_of(request)),
        )
        return Response({"customer": customer.slug, "models": names})
