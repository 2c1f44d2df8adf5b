"""One customer's reserved versus used MU per minute, per model: the chart of the planner's
customer page, and of the customer's own portal (portal/), which shows it for its own customer.

`utilisation_context` is everything `planner/customers/_utilisation.html` draws: the model
tabs, the range tabs and the chart (None when nothing was reserved or used in the range).
"""

from typing import Any

from django.http import HttpRequest
from django.utils import timezone

from accounts.models import Customer
from capacity.catalog.selectors import served_models_with_ids
from capacity.metering.selectors import used_model_ids_of_customer
from capacity.metering.utilisation import customer_utilisation
from capacity.models import ServedModel
from capacity.selling.selectors import reserved_model_ids_of_customer
from planner.charts import ChartConfig, chart_range, chart_window, line_chart, time_label


def models_of_customer(customer: Customer) -> list[ServedModel]:
    """The customer's models: those it reserves or used, reservations first."""
    reserved = reserved_model_ids_of_customer(customer)
    used = used_model_ids_of_customer(customer)
    return sorted(
        served_models_with_ids(reserved | used),
        key=lambda m: (m.pk not in reserved, m.name),
    )


def utilisation_chart(
    request: HttpRequest, customer: Customer, served_model: ServedModel
) -> tuple[str, ChartConfig | None]:
    """(range name, Chart.js config or None) of the customer's use of one model."""
    range_name, span, step = chart_range(request)
    start, end = chart_window(timezone.now(), span, step)
    buckets = customer_utilisation(
        customer=customer, served_model=served_model, start=start, end=end, step=step
    )
    if not any(b["reserved_mu_per_minute"] or b["used_mu"] for b in buckets):
        return range_name, None
    labels = [time_label(start + i * step, span) for i in range(len(buckets))]
    chart = line_chart(
        labels,
        [
            {
                "label": "Reserved MU/min",
                "data": [round(b["reserved_mu_per_minute"], 2) for b in buckets],
                "color": "#2563eb",
                "stepped": True,
            },
            {
                "label": "Used MU/min",
                "data": [round(b["used_mu_per_minute_mean"], 2) for b in buckets],
                "color": "#dc2626",
                "fill": "origin",
            },
        ],
        y_title="MU per minute",
    )
    return range_name, chart


def utilisation_context(request: HttpRequest, customer: Customer) -> dict[str, Any]:
    """The chart of the model named by `?model=` (else the first), over `?range=`."""
    models_used = models_of_customer(customer)
    wanted = request.GET.get("model")
    chosen = next((m for m in models_used if m.name == wanted), None)
    chosen = chosen or (models_used[0] if models_used else None)
    range_name, chart = (
        utilisation_chart(request, customer, chosen) if chosen else (chart_range(request)[0], None)
    )
    return {
        "models": models_used,
        "model": chosen,
        "range": range_name,
        "range_extra": f"model={chosen.name}" if chosen else "",
        "chart": chart,
    }
