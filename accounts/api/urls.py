from django.urls import path
from rest_framework.routers import SimpleRouter

from accounts.api.views import ApiKeyViewSet, CustomerViewSet, MeView

router = SimpleRouter()
router.register("customers", CustomerViewSet, basename="customer")
router.register("api-keys", ApiKeyViewSet, basename="api-key")

urlpatterns = [path("me", MeView.as_view(), name="me"), *router.urls]
