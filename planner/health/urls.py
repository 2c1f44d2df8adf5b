from django.urls import path

from planner.health import views

app_name = "health"

urlpatterns = [
    path("", views.index, name="index"),
    path("incidents/<int:pk>/", views.incident, name="incident"),
    path(
        "deployments/<str:name>/reset-fingerprint/",
        views.reset_fingerprint,
        name="reset-fingerprint",
    ),
    path("models/<str:name>/policy/", views.policy, name="policy"),
]
