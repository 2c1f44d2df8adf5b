from django.urls import path

from planner.invoices import views

app_name = "invoices"

urlpatterns = [
    path("", views.list, name="list"),
]
