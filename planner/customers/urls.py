from django.urls import path

from planner.customers import views

app_name = "customers"

urlpatterns = [
    path("", views.customer_list, name="list"),
    path("<slug:slug>/", views.detail, name="detail"),
    path("<slug:slug>/reservations/", views.reservation_new, name="reservation-new"),
    path(
        "<slug:slug>/reservations/<int:pk>/amend",
        views.reservation_amend_view,
        name="reservation-amend",
    ),
    path(
        "<slug:slug>/reservations/<int:pk>/cancel",
        views.reservation_cancel_view,
        name="reservation-cancel",
    ),
    path("<slug:slug>/api-keys/", views.api_key_new, name="key-new"),
    path("<slug:slug>/api-keys/<int:pk>/revoke", views.api_key_revoke_view, name="key-revoke"),
    path("<slug:slug>/people/<int:pk>/remove", views.membership_remove_view, name="person-remove"),
    path("<slug:slug>/request-limits/", views.request_limit_set_view, name="limit-set"),
    path(
        "<slug:slug>/request-limits/<int:pk>/delete",
        views.request_limit_delete_view,
        name="limit-delete",
    ),
]
