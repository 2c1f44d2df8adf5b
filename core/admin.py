from django.contrib import admin

from core.audit import ReadOnlyAdminMixin
from core.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """The audit log is written by services only: nobody edits or deletes history here."""

    list_display = ["at", "actor", "action", "object_type", "object_repr"]
    list_filter = ["action", "object_type"]
    search_fields = ["actor", "action", "object_repr", "object_id", "reason"]
    date_hierarchy = "at"
