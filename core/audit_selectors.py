"""Reads of the audit log for the planner's audit page (`core.audit.entries_about`
reads one object's history)."""

from django.db.models import Q, QuerySet

from core.models import AuditEntry


def audit_entries_newest_first(
    *, action: str = "", object_type: str = "", object_id: str = "", text: str = ""
) -> QuerySet[AuditEntry]:
    """Entries narrowed to an action, an object type (and one object of it) and a text in the
    actor, the object's name or the reason, each when given."""
    entries = AuditEntry.objects.all()
    if action:
        entries = entries.filter(action=action)
    if object_type:
        entries = entries.filter(object_type=object_type)
        if object_id:
            entries = entries.filter(object_id=object_id)
    if text:
        entries = entries.filter(
            Q(actor__icontains=text) | Q(object_repr__icontains=text) | Q(reason__icontains=text)
        )
    return entries.order_by("-at", "-id")


def audit_actions() -> QuerySet:
    """Every action the log holds, once each, alphabetically."""
    return AuditEntry.objects.order_by("action").values_list("action", flat=True).distinct()


def audit_object_types() -> QuerySet:
    """Every object type the log holds, once each, alphabetically."""
    return (
        AuditEntry.objects.order_by("object_type").values_list("object_type", flat=True).distinct()
    )


def any_audit_entries() -> bool:
    """Whether the log holds anything: the audit page says "none yet" rather than "no match"."""
    return AuditEntry.objects.exists()
