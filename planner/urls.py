"""The planner UI under /planner/: one sub-package per section, each with its own urls."""

from django.urls import include, path

from planner.fleet import views as fleet

app_name = "planner"

urlpatterns = [
    path("", fleet.fleet, name="fleet"),
    path("customers/", include("planner.customers.urls")),
    path("tiers/", include("planner.tiers.urls")),
    path("benchmarks/", include("planner.benchmarks.urls")),
    path("allocation/", include("planner.allocation.urls")),
    path("health/", include("planner.health.urls")),
    path("what-if/", include("planner.whatif.urls")),
    path("invoices/", include("planner.invoices.urls")),
    path("audit/", include("planner.audit.urls")),
]
