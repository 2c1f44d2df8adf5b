from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, viewsets
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.permissions import ReadScope
from accounts.principals import principal_of
from capacity.allocation.wake import request_tick
from capacity.models import (
    ActuatorCircuit,
    AdmissionAllowance,
    AllocationDecision,
    Deployment,
    ServedModel,
)
from core.api.serializers import StrictSerializer


class GatewayOrPlanner(BasePermission):
    """Waking the loop is for the platform's gateways (service keys that post usage) and
    planners: a tick a second is cheap, but no customer key should be able to drive it."""

    message = "Only planners and gateway service keys (usage:write) may wake the loop."

    def has_permission(self, request, view) -> bool:
        principal = principal_of(request)
        return principal.is_planner or (principal.is_service and principal.has_scope(S.USAGE_WRITE))


class WakeSerializer(StrictSerializer):
    model = serializers.CharField(max_length=100, help_text="The model requests wait for.")


class AllocationWakeView(APIView):
    """A gateway holds requests for a model without a ready replica: run a tick now (at most
    one a second) so the model wakes without waiting for the next 15 s tick."""

    permission_classes = [GatewayOrPlanner]

    @extend_schema(
        request=WakeSerializer,
        responses={
            202: inline_serializer(
                "AllocationWake",
                {"model": serializers.CharField(), "queued": serializers.BooleanField()},
            )
        },
    )
    def post(self, request):
        body = WakeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        name = body.validated_data["model"]
        if not ServedModel.objects.filter(name=name).exists():
            raise ValidationError({"model": [f"no model named '{name}'"]})
        queued = request_tick(reason=f"requests waiting for {name}")
        return Response({"model": name, "queued": queued}, status=202)


class FleetReader(BasePermission):
    """Allocation is the operator's business: planners and platform services."""

    message = "Only planners and platform services see allocation decisions."

    def has_permission(self, request, view) -> bool:
        principal = principal_of(request)
        return principal.is_planner or (principal.is_service and principal.has_scope(S.READ))


class AllocationDecisionSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    model = serializers.SlugRelatedField(source="served_model", slug_field="name", read_only=True)

    class Meta:
        model = AllocationDecision
        fields = [
            "id",
            "tick_id",
            "deployment",
            "model",
            "created_at",
            "inputs_digest",
            "current_replicas",
            "ready_replicas",
            "starting_replicas",
            "draining_replicas",
            "recommended_replicas",
            "target_replicas",
            "reasons",
            "actuator_kind",
            "actuator_ok",
            "actuator_attempts",
            "actuator_error",
            "observed_replicas",
            "observed_spec_replicas",
            "applied_at",
        ]
        read_only_fields = fields


class AllocationDecisionViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = AllocationDecisionSerializer
    permission_classes = [FleetReader]
    queryset = AllocationDecision.objects.select_related("deployment", "served_model")
    filterset_fields = {
        "deployment__name": ["exact"],
        "served_model__name": ["exact"],
        "actuator_ok": ["exact"],
        "created_at": ["gte", "lte"],
    }
    ordering_fields = ["created_at"]


class AllowanceSerializer(serializers.ModelSerializer):
    customer = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    model = serializers.SlugRelatedField(source="served_model", slug_field="name", read_only=True)

    class Meta:
        model = AdmissionAllowance
        fields = [
            "customer",
            "model",
            "guaranteed_mu_per_minute",
            "best_effort_mu_per_minute",
            "tick_id",
            "updated_at",
        ]
        read_only_fields = fields


class AllowanceViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """The latest tick's admission limits; a customer sees its own."""

    serializer_class = AllowanceSerializer
    permission_classes = [ReadScope]
    filterset_fields = {"customer__slug": ["exact"], "served_model__name": ["exact"]}

    def get_queryset(self):
        principal = principal_of(self.request)
        queryset = AdmissionAllowance.objects.select_related("customer", "served_model")
        if principal.sees_all_customers:
            return queryset
        return queryset.filter(customer_id__in=principal.customer_ids)


class ModelWhyView(APIView):
    """Why each deployment of a model has its current target, in words."""

    permission_classes = [FleetReader]

    @extend_schema(
        responses=inline_serializer(
            "AllocationWhy",
            {"model": serializers.CharField(), "deployments": serializers.ListField()},
        )
    )
    def get(self, request, name):
        if not principal_of(request).has_scope(S.READ):
            raise PermissionDenied()
        served_model = get_object_or_404(ServedModel, name=name)
        deployments = []
        for deployment in Deployment.objects.filter(served_model=served_model).order_by("name"):
            latest = deployment.allocation_decisions.order_by("-created_at", "-id").first()
            circuit = ActuatorCircuit.objects.filter(deployment=deployment).first()
            if latest is None:
                text = "No tick has decided anything for this deployment yet."
            else:
                change = (
                    f"from {latest.current_replicas} to {latest.target_replicas} replicas"
                    if latest.target_replicas != latest.current_replicas
                    else f"at {latest.target_replicas} replicas"
                )
                reasons = "; ".join(reason["message"] for reason in latest.reasons)
                text = (
                    f"The last tick ({latest.created_at:%H:%M:%S} UTC) kept {deployment.name} "
                    f"{change}: {reasons or 'no demand and nothing reserved'}."
                )
                if latest.actuator_ok is False:
                    text += f" Applying it failed: {latest.actuator_error}"
            deployments.append(
                {
                    "deployment": deployment.name,
                    "current_replicas": deployment.current_replicas,
                    "target_replicas": latest.target_replicas if latest else None,
                    "why": text,
                    "reasons": latest.reasons if latest else [],
                    "circuit_open_until": circuit.opened_until if circuit else None,
                    "consecutive_failures": circuit.consecutive_failures if circuit else 0,
                }
            )
        return Response({"model": served_model.name, "deployments": deployments})
