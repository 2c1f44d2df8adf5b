from rest_framework import viewsets
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
        serializer.instance = type(self).create_service(**serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = services.catalog_update(
            instance=serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance):
        services.catalog_delete(instance=instance)


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
        serializer.instance = services.gpu_pool_create(**serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = services.gpu_pool_update(
            pool=serializer.instance, **serializer.validated_data
        )


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
        serializer.instance = services.deployment_create(**serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = services.deployment_update(
            deployment=serializer.instance, **serializer.validated_data
        )
