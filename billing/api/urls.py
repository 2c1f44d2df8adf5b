from django.urls import path
from rest_framework.routers import SimpleRouter

from billing.api.views import (
    BudgetViewSet,
    EstimateView,
    InvoiceViewSet,
    MarginView,
    RateCardViewSet,
)

router = SimpleRouter()
router.register("invoices", InvoiceViewSet, basename="invoice")
router.register("rate-cards", RateCardViewSet, basename="rate-card")
router.register("budgets", BudgetViewSet, basename="budget")

urlpatterns = [
    path("customers/<slug:slug>/billing/estimate", EstimateView.as_view(), name="billing-estimate"),
    path("billing/margin", MarginView.as_view(), name="billing-margin"),
    *router.urls,
]
