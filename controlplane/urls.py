from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views import defaults
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularSwaggerSplitView

from core import liveness, metrics_view
from core.api.errors import json_404, json_500
from core.api.schema import SchemaView

api_v1 = [
    path("", include("accounts.api.urls")),
    path("", include("capacity.api.urls")),
    path("", include("benchmarking.api.urls")),
    path("", include("billing.api.urls")),
]

urlpatterns = [
    path("healthz", liveness.healthz, name="healthz"),
    path("readyz", liveness.readyz, name="readyz"),
    # Prometheus's, with METRICS_TOKEN; the production Ingress does not route it.
    path("metrics", metrics_view.metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path(
        "login/",
        auth_views.LoginView.as_view(redirect_authenticated_user=False),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("planner/", include("planner.urls")),
    path("portal/", include("portal.urls")),
    path("", RedirectView.as_view(pattern_name="planner:fleet", permanent=False)),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    # Split: the page's init script comes from this URL too (?script), so the Content Security
    # Policy allows scripts from this server only.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
]


def handler404(request, exception=None):
    # API clients get the one error body shape; people get Django's page.
    if request.path.startswith("/api/"):
        return json_404(request, exception)
    return defaults.page_not_found(request, exception)


def handler500(request):
    if request.path.startswith("/api/"):
        return json_500(request)
    return defaults.server_error(request)
