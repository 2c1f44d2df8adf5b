from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, viewsets
from rest_framework.permissions import SAFE_METHODS

from accounts.permissions import CatalogPermission
from accounts.principals import principal_of
from capacity.api.catalog_serializers import (
    DeploymentPublicSerializer,
    DeploymentSerializer,
    GpuPoolSerializer,
    GpuTypePublicSerializer,
    GpuTypeSerializer,
    ServedModelSerializer,
)
from capacity.catalog import selectors, services


class _CatalogViewSet(viewsets.ModelViewSet):
    """Anyone signed in reads; planners (or `catalog:write` service keys) write."""

    permission_classes = [CatalogPermission]
    lookup_field = "name"
    lookup_value_regex = r"[^/]+"
    search_fields = ["name"]
    ordering_fields = ["name"]
    create_service = None
    # Customers (members and customer keys) read this; planners and service keys the full one.
    public_serializer_class = None

    def get_serializer_class(self):
        if (
            self.public_serializer_class is not None
            and not getattr(self, "swagger_fake_view", False)
            and self.request.method in SAFE_METHODS
        ):
            principal = principal_of(self.request)
            if not (principal.is_planner or principal.is_service):
                return self.public_serializer_class
        return super().get_serializer_class()

    def perform_create(self, serializer):
        serializer.instance = type(self).create_service(**_without_force(serializer)[0])

    def perform_update(self, serializer):
        changes, force = _without_force(serializer)
        serializer.instance = services.catalog_update(
            instance=serializer.instance, **changes, **force
        )

    @extend_schema(parameters=[
        OpenApiParameter("force", bool, description="Delete even though sold reservations "
                         "would be at risk (with force_reason)."),
        OpenApiParameter("force_reason", str, description="Why it is forced (the audit log)."),
    ])  # fmt: skip
    def destroy(self, request, *args, **kwargs):
        return super().destroy(request, *args, **kwargs)

    def perform_destroy(self, instance):
        query = _ForceQuery(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        services.catalog_delete(instance=instance, **query.validated_data)


class _ForceQuery(serializers.Serializer):
    force = serializers.BooleanField(required=False, default=False)
    force_reason = serializers.CharField(required=False, default="", max_length=2000)


def _without_force(serializer) -> tuple[dict, dict]:
    """The fields to write, and force/force_reason for the at-risk check."""
    data = dict(serializer.validated_data)
    force = {"force": data.pop("force", False), "force_reason": data.pop("force_reason", "")}
    return data, force


class GpuTypeViewSet(_CatalogViewSet):
    serializer_class = GpuTypeSerializer
    public_serializer_class = GpuTypePublicSerializer
    queryset = selectors.gpu_types()
    create_service = staticmethod(services.gpu_type_create)


class GpuPoolViewSet(_CatalogViewSet):
    serializer_class = GpuPoolSerializer
    queryset = selectors.gpu_pools()
    filterset_fields = {"gpu_type__name": ["exact"]}
    ordering_fields = ["name", "gpu_count"]

    def perform_create(self, serializer):
        serializer.instance = services.gpu_pool_create(**_without_force(serializer)[0])

    def perform_update(self, serializer):
        changes, force = _without_force(serializer)
        serializer.instance = services.gpu_pool_update(pool=serializer.instance, **changes, **force)


class ServedModelViewSet(_CatalogViewSet):
    serializer_class = ServedModelSerializer
    queryset = selectors.served_models()
    filterset_fields = {"reference_gpu_type__name": ["exact"]}
    search_fields = ["name", "engine_model_id"]
    create_service = staticmethod(services.served_model_create)


class DeploymentViewSet(_CatalogViewSet):
    serializer_class = DeploymentSerializer
    public_serializer_class = DeploymentPublicSerializer
    queryset = selectors.deployments()
    filterset_fields = {
        "served_model__name": ["exact"],
        "gpu_pool__name": ["exact"],
        "actuator_kind": ["exact"],
    }
    ordering_fields = ["name", "current_replicas", "max_replicas"]

    def perform_create(self, serializer):
        serializer.instance = services.deployment_create(**_without_force(serializer)[0])

    def perform_update(self, serializer):
        changes, force = _without_force(serializer)
        serializer.instance = services.deployment_update(
            deployment=serializer.instance, **changes, **force
        )
