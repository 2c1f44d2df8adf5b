"""`{% demo_history_note %}`: the note above every planner page of a demo whose history was
simulated (seed_demo's `demo.history` audit entry), so no one takes it for a real fleet's."""

from datetime import datetime
from typing import Any

from django import template

from simulation.demo_history import ACTUATOR_KIND, demo_history_marker

register = template.Library()


@register.inclusion_tag("planner/_demo_history.html")
def demo_history_note() -> dict[str, Any]:
    """The simulated history's span, scenario and sizes, from its marker; None as the marker
    on a fleet without demo data (no note)."""
    marker = demo_history_marker()
    if marker is None or not marker.after:
        return {"marker": None}
    after = marker.after
    return {
        "marker": marker,
        "start": datetime.fromisoformat(after["from"]),
        "end": datetime.fromisoformat(after["to"]),
        "scenario": after.get("scenario", []),
        "sizes": after.get("sizes", []),
        "weight": after.get("requests_per_simulated_request"),
        "deployment": after.get("simulated_deployment"),
        "actuator_kind": ACTUATOR_KIND,
    }
