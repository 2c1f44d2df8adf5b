"""The customer portal under /portal/: one customer's pages under /portal/<slug>/, served to
that customer's members only (portal.access)."""

from django.urls import path

from portal import views

app_name = "portal"

urlpatterns = [
    path("", views.home, name="home"),
    path("<slug:slug>/", views.overview, name="overview"),
    path("<slug:slug>/usage/", views.usage, name="usage"),
    path("<slug:slug>/keys/", views.keys, name="keys"),
    path("<slug:slug>/keys/new", views.key_new, name="key-new"),
    path("<slug:slug>/keys/<int:pk>/revoke", views.key_revoke, name="key-revoke"),
    path("<slug:slug>/people/", views.people, name="people"),
    path("<slug:slug>/people/<int:pk>/remove", views.person_remove, name="person-remove"),
    path("<slug:slug>/limits/", views.limits, name="limits"),
    path("<slug:slug>/invoices/", views.invoices, name="invoices"),
    path("<slug:slug>/invoices/<int:pk>/", views.invoice, name="invoice"),
    path(
        "<slug:slug>/invoices/<int:pk>/download/<str:format_name>",
        views.invoice_file,
        name="invoice-file",
    ),
]
