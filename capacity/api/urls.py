from rest_framework.routers import SimpleRouter

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

urlpatterns = router.urls
