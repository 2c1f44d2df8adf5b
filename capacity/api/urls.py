from django.urls import path
from rest_framework.routers import SimpleRouter

from capacity.api.cost_model_views import CostEstimateView, CostModelViewSet
from capacity.api.views import (
    DeploymentViewSet,
    GpuPoolViewSet,
    GpuTypeViewSet,
    ServedModelViewSet,
)

router = SimpleRouter()
router.register("gpu-types", GpuTypeViewSet, basename="gpu-type")
router.register("gpu-pools", GpuPoolViewSet, basename="gpu-pool")
router.register("models", ServedModelViewSet, basename="served-model")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("cost-models", CostModelViewSet, basename="cost-model")

urlpatterns = [
    path("cost-models/estimate", CostEstimateView.as_view(), name="cost-estimate"),
    *router.urls,
]
