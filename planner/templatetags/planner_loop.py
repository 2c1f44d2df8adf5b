"""`{% tick_alert %}`: the alert above every planner page while the allocation tick is stale
(capacity.allocation.heartbeat): admission keeps every reservation's floor without it, but
best-effort allowances decay and the fleet is not resized until it is back."""

from typing import Any

from django import template

from capacity.allocation.heartbeat import tick_state

register = template.Library()


@register.inclusion_tag("planner/_tick_alert.html")
def tick_alert() -> dict[str, Any]:
    """The tick's state while it is stale, else None (no alert)."""
    state = tick_state()
    return {"state": state if state.stale else None}
