from django.urls import path

from planner.benchmarks import views

app_name = "benchmarks"

urlpatterns = [
    path("", views.runs, name="runs"),
    path("runs/table/", views.runs_table, name="runs_table"),
    path("runs/<int:pk>/", views.run_detail, name="run_detail"),
    path("runs/<int:pk>/live/", views.run_live, name="run_live"),
    path("cost-models/", views.cost_models, name="cost_models"),
    path(
        "cost-models/<str:model>/<int:gpu_type>/<int:gpus>/",
        views.cost_model,
        name="cost_model",
    ),
    path(
        "cost-models/<str:model>/<int:gpu_type>/<int:gpus>/run/",
        views.run_now,
        name="run_now",
    ),
    path(
        "cost-model-versions/<int:pk>/activate/",
        views.version_activate,
        name="version_activate",
    ),
    path("cost-model-versions/<int:pk>/reject/", views.version_reject, name="version_reject"),
    path("cost-model-versions/<int:pk>/retire/", views.version_retire, name="version_retire"),
]
