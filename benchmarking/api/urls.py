from rest_framework.routers import SimpleRouter

from benchmarking.api.views import BenchmarkRunViewSet, BenchmarkSuiteViewSet

router = SimpleRouter()
router.register("benchmark-suites", BenchmarkSuiteViewSet, basename="benchmark-suite")
router.register("benchmark-runs", BenchmarkRunViewSet, basename="benchmark-run")

urlpatterns = router.urls
