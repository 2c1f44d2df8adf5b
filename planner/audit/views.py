"""The audit log: every change, who made it, before → after; filtered to one object from the
history boxes of the other pages."""

from urllib.parse import urlencode

from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from core.audit_selectors import (
    any_audit_entries,
    audit_actions,
    audit_entries_newest_first,
    audit_object_types,
)
from planner.access import planner_required
from planner.paging import page_of, query_without


@planner_required
def audit_list(request: HttpRequest) -> HttpResponse:
    """The audit entries, newest first, filtered by text, action, object type and object."""
    filters = {name: request.GET.get(name, "").strip() for name in ("q", "action", "object_type")}
    object_id = request.GET.get("object_id", "").strip()
    entries = audit_entries_newest_first(
        action=filters["action"],
        object_type=filters["object_type"],
        object_id=object_id,
        text=filters["q"],
    )
    context = {
        "page": page_of(request, entries),
        "query": query_without(request),
        "actions": audit_actions(),
        "object_types": audit_object_types(),
        "object_id": object_id,
        "any_entries": any_audit_entries(),
        **filters,
    }
    return render(request, "planner/audit/list.html", context)


def audit_link(obj: Model) -> str:
    """The audit page filtered to one object's history."""
    query = urlencode({"object_type": obj._meta.label_lower, "object_id": obj.pk})
    return f"{reverse('planner:audit:list')}?{query}"
