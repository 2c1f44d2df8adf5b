from django.urls import path

from planner.benchmarks import views

app_name = "benchmarks"

urlpatterns = [
    path("", views.runs, name="runs"),
]
