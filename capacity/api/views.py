from rest_framework import viewsets

from accounts.permissions import CatalogPermission
from capacity import selectors, services
from capacity.api.serializers import (
    DeploymentSerializer,
    GpuPoolSerializer,
    GpuTypeSerializer,
    ServedModelSerializer,
)


class _CatalogViewSet(viewsets.ModelViewSet):
    """Anyone signed in reads; planners (or `catalog:write` service keys) write."""

    permission_classes = [CatalogPermission]
    lookup_field = "name"
    lookup_value_regex = r"[^/]+"
    search_fields = ["name"]
    ordering_fields = ["name"]
    create_service = None

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
