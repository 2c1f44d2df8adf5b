from django.urls import path

from planner.tiers import views

app_name = "tiers"

urlpatterns = [
    path("", views.tier_list, name="list"),
    path("<slug:name>/", views.tier_change, name="change"),
    path("<slug:name>/delete", views.tier_delete_view, name="delete"),
]
