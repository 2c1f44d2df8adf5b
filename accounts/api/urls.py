from django.urls import path
from rest_framework.routers import SimpleRouter

from accounts.api.views import ApiKeyViewSet, CustomerViewSet, MeView, TierViewSet

router = SimpleRouter()
router.register("customers", CustomerViewSet, basename="customer")
router.register("api-keys", ApiKeyViewSet, basename="api-key")
router.register("tiers", TierViewSet, basename="tier")

urlpatterns = [path("me", MeView.as_view(), name="me"), *router.urls]
