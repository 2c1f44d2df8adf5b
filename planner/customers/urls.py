from django.urls import path

from planner.customers import views

app_name = "customers"

urlpatterns = [
    path("", views.list, name="list"),
]
