"""`{% portal_demo_note %}`: the portal's note on a demo whose history was simulated
(seed_demo's `demo.history` audit entry). Shorter than the planner's, which names every demo
customer: a customer's page names no other customer."""

from datetime import datetime
from typing import Any

from django import template

from simulation.demo_history import demo_history_marker

register = template.Library()


@register.inclusion_tag("portal/_demo_note.html")
def portal_demo_note() -> dict[str, Any]:
    """The simulated history's span, from its marker; None as the marker on a fleet without
    demo data (no note)."""
    marker = demo_history_marker()
    if marker is None or not marker.after:
        return {"marker": None}
    return {
        "marker": marker,
        "start": datetime.fromisoformat(marker.after["from"]),
        "end": datetime.fromisoformat(marker.after["to"]),
    }
