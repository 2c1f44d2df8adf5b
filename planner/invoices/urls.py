from django.urls import path

from planner.invoices import views

app_name = "invoices"

urlpatterns = [
    path("", views.invoice_list, name="list"),
    path("<int:pk>/", views.invoice_detail, name="detail"),
    path("<int:pk>/issue", views.invoice_issue_view, name="issue"),
]
