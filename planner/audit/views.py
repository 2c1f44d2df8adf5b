"""The audit log: every change, who made it, before → after; filtered to one object from the
history boxes of the other pages."""

from urllib.parse import urlencode

from django.db.models import Q
from django.shortcuts import render
from django.urls import reverse

from controlplane.models import AuditEntry
from planner.access import planner_required
from planner.paging import page_of, query_without


@planner_required
def audit_list(request):
    entries = AuditEntry.objects.all()
    filters = {name: request.GET.get(name, "").strip() for name in ("q", "action", "object_type")}
    object_id = request.GET.get("object_id", "").strip()
    if filters["action"]:
        entries = entries.filter(action=filters["action"])
    if filters["object_type"]:
        entries = entries.filter(object_type=filters["object_type"])
        if object_id:
            entries = entries.filter(object_id=object_id)
    if filters["q"]:
        query = filters["q"]
        entries = entries.filter(
            Q(actor__icontains=query) | Q(object_repr__icontains=query) | Q(reason__icontains=query)
        )
    context = {
        "page": page_of(request, entries.order_by("-at", "-id")),
        "query": query_without(request),
        "actions": AuditEntry.objects.order_by("action")
        .values_list("action", flat=True)
        .distinct(),
        "object_types": (
            AuditEntry.objects.order_by("object_type")
            .values_list("object_type", flat=True)
            .distinct()
        ),
        "object_id": object_id,
        "any_entries": AuditEntry.objects.exists(),
        **filters,
    }
    return render(request, "planner/audit/list.html", context)


def audit_link(obj) -> str:
    """The audit page filtered to one object's history."""
    query = urlencode({"object_type": obj._meta.label_lower, "object_id": obj.pk})
    return f"{reverse('planner:audit:list')}?{query}"
