"""Chart.js configurations built on the server; `static/planner/charts.js` only draws them.

Times are labels (UTC, formatted here), so the vendored Chart.js needs no date adapter.
"""

from datetime import datetime, timedelta
from typing import Any, TypeAlias

from django.http import HttpRequest

# A Chart.js configuration (its JSON, as json_script writes it into the page).
ChartConfig: TypeAlias = dict[str, Any]

# Ranges a time-series chart offers, with the bucket each point summarises.
RANGES = {
    "24h": (timedelta(hours=24), timedelta(minutes=10)),
    "7d": (timedelta(days=7), timedelta(hours=1)),
}
DEFAULT_RANGE = "24h"

PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"]


def chart_range(request: HttpRequest) -> tuple[str, timedelta, timedelta]:
    """The range `?range=` names (else the default): its name, span and bucket."""
    name = request.GET.get("range", DEFAULT_RANGE)
    if name not in RANGES:
        name = DEFAULT_RANGE
    span, step = RANGES[name]
    return name, span, step


def chart_window(now: datetime, span: timedelta, step: timedelta) -> tuple[datetime, datetime]:
    """[start, end) ending with the bucket that holds `now`, on whole steps since the epoch."""
    epoch = datetime(1970, 1, 1, tzinfo=now.tzinfo)
    end = epoch + ((now - epoch) // step + 1) * step
    return end - span, end


def time_label(moment: datetime, span: timedelta) -> str:
    """A bucket's label: the time of day, with the weekday on charts longer than a day."""
    return moment.strftime("%H:%M" if span <= timedelta(days=1) else "%a %H:%M")


def line_chart(
    labels: list[str], datasets: list[dict[str, Any]], *, y_title: str, x_title: str = "UTC"
) -> ChartConfig:
    """A line chart of the datasets over the labels; a dataset's `color` (else the palette's
    next) colours its line and fill."""
    styled = []
    for index, dataset in enumerate(datasets):
        color = dataset.pop("color", PALETTE[index % len(PALETTE)])
        styled.append(
            {
                "borderColor": color,
                "backgroundColor": color + "33",
                # Small points: a lone sample between gaps (the loop was down) still shows.
                "pointRadius": 1.5,
                "borderWidth": 2,
                "tension": 0,
                "spanGaps": False,
                **dataset,
            }
        )
    return {
        "type": "line",
        "data": {"labels": labels, "datasets": styled},
        "options": {
            "animation": False,
            "responsive": True,
            "maintainAspectRatio": False,
            "interaction": {"mode": "index", "intersect": False},
            "scales": {
                "x": {"title": {"display": True, "text": x_title}, "ticks": {"maxTicksLimit": 12}},
                "y": {"title": {"display": True, "text": y_title}, "beginAtZero": True},
            },
        },
    }


def scatter_chart(
    datasets: list[dict[str, Any]], *, x_title: str, y_title: str, diagonal_to: float = 0
) -> ChartConfig:
    """A scatter chart of the datasets; with diagonal_to, the line y = x from 0 to it (where
    predicted equals measured)."""
    styled = [
        {
            "backgroundColor": dataset.pop("color", PALETTE[index % len(PALETTE)]),
            "pointRadius": 4,
            **dataset,
        }
        for index, dataset in enumerate(datasets)
    ]
    if diagonal_to > 0:
        styled.append(
            {
                "type": "line",
                "label": "predicted = measured",
                "data": [{"x": 0, "y": 0}, {"x": diagonal_to, "y": diagonal_to}],
                "borderColor": "#9ca3af",
                "borderDash": [6, 4],
                "pointRadius": 0,
                "borderWidth": 1,
            }
        )
    return {
        "type": "scatter",
        "data": {"datasets": styled},
        "options": {
            "animation": False,
            "responsive": True,
            "maintainAspectRatio": False,
            "scales": {
                "x": {"title": {"display": True, "text": x_title}, "beginAtZero": True},
                "y": {"title": {"display": True, "text": y_title}, "beginAtZero": True},
            },
        },
    }
