"""Project-wide records that every app writes: the audit log."""

from django.db import models
from django.utils import timezone


class AuditEntry(models.Model):
    """One change: who made it, to what, and the object before and after (docs/design.md#audit).

    Written by services (never by signals or `save()`), in the same transaction as the change,
    so a rolled-back change leaves no entry and a committed one always has its entry.
    """

    # serves: audit_selectors.audit_entries_newest_first (the audit list by -at)
    at = models.DateTimeField(default=timezone.now, db_index=True)
    # "user:alice", "key:mu1a2b3c4d5e6f (customer:acme)", "system:migration …": who acted.
    actor = models.CharField(max_length=200)
    action = models.CharField(max_length=100, help_text='What happened, e.g. "api_key.create".')
    object_type = models.CharField(max_length=100, help_text='e.g. "accounts.apikey".')
    object_id = models.CharField(max_length=100, blank=True, default="")
    object_repr = models.CharField(max_length=200, blank=True, default="")
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            # An object's own history (the planner's per-object view).
            # serves: core.audit.entries_about; the audit list filtered to one object
            models.Index(fields=["object_type", "object_id", "-at"], name="audit_object_history"),
        ]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_repr}"
