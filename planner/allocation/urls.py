from django.urls import path

from planner.allocation import views

app_name = "allocation"

urlpatterns = [
    path("", views.index, name="index"),
    path("deployments/<str:name>/", views.deployment, name="deployment"),
]
