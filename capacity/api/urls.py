from django.urls import path
from rest_framework.routers import SimpleRouter

from capacity.api.admission_views import AdmissionView, RequestLimitViewSet
from capacity.api.allocation_views import (
    AllocationDecisionViewSet,
    AllocationWakeView,
    AllowanceViewSet,
    ModelWhyView,
)
from capacity.api.catalog_views import (
    DeploymentViewSet,
    GpuPoolViewSet,
    GpuTypeViewSet,
    ServedModelViewSet,
)
from capacity.api.health_views import (
    DegradationListView,
    IncidentListView,
    PolicyView,
    ReplicaListView,
    ResetFingerprintView,
)
from capacity.api.metering_views import (
    CustomerUtilisationView,
    ModelCapacityView,
    UsageEventsCsvView,
    UsageEventsView,
)
from capacity.api.pricing_views import CostEstimateView, CostModelViewSet
from capacity.api.selling_views import CustomerEntitlementsView, ReservationViewSet

router = SimpleRouter()
router.register("gpu-types", GpuTypeViewSet, basename="gpu-type")
router.register("gpu-pools", GpuPoolViewSet, basename="gpu-pool")
router.register("models", ServedModelViewSet, basename="served-model")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("cost-models", CostModelViewSet, basename="cost-model")
router.register("reservations", ReservationViewSet, basename="reservation")
router.register("allocation/decisions", AllocationDecisionViewSet, basename="allocation-decision")
router.register("allocation/allowances", AllowanceViewSet, basename="allocation-allowance")
router.register("request-limits", RequestLimitViewSet, basename="request-limit")

urlpatterns = [
    path("cost-models/estimate", CostEstimateView.as_view(), name="cost-estimate"),
    path("usage/events", UsageEventsView.as_view(), name="usage-events"),
    path("usage/events/csv", UsageEventsCsvView.as_view(), name="usage-events-csv"),
    path("admission", AdmissionView.as_view(), name="admission"),
    path("allocation/wake", AllocationWakeView.as_view(), name="allocation-wake"),
    path(
        "customers/<slug:slug>/utilisation",
        CustomerUtilisationView.as_view(),
        name="customer-utilisation",
    ),
    path(
        "customers/<slug:slug>/entitlements",
        CustomerEntitlementsView.as_view(),
        name="customer-entitlements",
    ),
    path("models/<str:name>/capacity", ModelCapacityView.as_view(), name="model-capacity"),
    path("models/<str:name>/why", ModelWhyView.as_view(), name="model-why"),
    path("health/replicas", ReplicaListView.as_view(), name="health-replicas"),
    path("health/incidents", IncidentListView.as_view(), name="health-incidents"),
    path(
        "health/deployments/<str:name>/reset-fingerprint",
        ResetFingerprintView.as_view(),
        name="health-reset-fingerprint",
    ),
    path("degradation/", DegradationListView.as_view(), name="degradation"),
    path(
        "degradation/<str:model_name>/policy",
        PolicyView.as_view(),
        name="degradation-policy",
    ),
    *router.urls,
]
