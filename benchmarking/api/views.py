from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts import scopes as S
from accounts.permissions import OPERATORS, scoped_permission
from benchmarking import selectors, services
from benchmarking.api.serializers import (
    BenchmarkRunCreateSerializer,
    BenchmarkRunSerializer,
    BenchmarkSampleSerializer,
    BenchmarkSuiteSerializer,
)

# Benchmarks are the fleet's internals: planners, and service keys (read; catalog:write to
# change), never customers.
BenchmarkPermission = scoped_permission(
    "BenchmarkPermission",
    message="Only planners and platform services see benchmarks.",
    write_scope=S.CATALOG_WRITE,
    readers=OPERATORS,
)


class BenchmarkSuiteViewSet(viewsets.ModelViewSet):
    serializer_class = BenchmarkSuiteSerializer
    permission_classes = [BenchmarkPermission]
    queryset = selectors.suites()
    lookup_field = "name"
    lookup_value_regex = r"[^/]+"
    search_fields = ["name", "description"]
    ordering_fields = ["name", "created_at"]

    def perform_create(self, serializer):
        serializer.instance = services.suite_create(**serializer.validated_data)

    def perform_update(self, serializer):
        if "grid" in serializer.validated_data:
            services.validate_grid(serializer.validated_data["grid"])
        serializer.save()


class BenchmarkRunViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    viewsets.GenericViewSet,
):
    """Runs are rows: create one to queue it, then read its status and progress."""

    serializer_class = BenchmarkRunSerializer
    permission_classes = [BenchmarkPermission]
    queryset = selectors.runs()
    filterset_fields = {
        "status": ["exact"],
        "source": ["exact"],
        "served_model__name": ["exact"],
        "gpu_type__name": ["exact"],
        "deployment__name": ["exact"],
        "suite__name": ["exact"],
    }
    ordering_fields = ["created_at", "finished_at"]

    @extend_schema(request=BenchmarkRunCreateSerializer, responses={201: BenchmarkRunSerializer})
    def create(self, request, *args, **kwargs):
        serializer = BenchmarkRunCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = services.run_queue(**serializer.validated_data)
        return Response(BenchmarkRunSerializer(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=BenchmarkSampleSerializer(many=True))
    @action(detail=True, methods=["get"])
    def samples(self, request, pk=None):
        run = self.get_object()
        page = self.paginate_queryset(selectors.samples_of(run))
        return self.get_paginated_response(BenchmarkSampleSerializer(page, many=True).data)
