from django.urls import path

from planner.whatif import views

app_name = "whatif"

urlpatterns = [
    path("", views.index, name="index"),
    path("<int:pk>/", views.detail, name="detail"),
    path("<int:pk>/progress/", views.progress, name="progress"),
]
