from django.conf import settings
from django.db import models

from capacity.models import ServedModel


class WhatIfRun(models.Model):
    """A what-if: the fleet simulator over one trace with a planner's settings (long work is
    this row; the Celery task fills in progress and the result, see simulation/whatif.py).

    `served_model` is the model whose fleet it simulates: `settings["fleet"]` holds what was
    read of it (its unit deployment's keys, and `deployments`: each deployment's cost model,
    engine profile, replica and limits; `pools`, `skipped`, the fleet's cap) and
    `settings["model_config"]` the unit deployment's replica; with a pasted replica profile, or
    no model, that profile or the built-in 8B-on-H100 emulator profile instead
    (`settings["fleet"]` empty). Runs from before whole-model what-ifs keep one deployment's
    keys and no `deployments`.
    The trace is a bundled one (`trace_name`) or a CSV kept in `trace_csv`: uploaded, or the
    model's own usage (`settings["trace_source"] == "usage"`).
    `result` is `compare()`'s output (with a fleet: each policy's `cost_usd`, and under
    `deployments` each deployment's replica-hours, GPU-hours and cost) plus the trace and fleet
    cap that were simulated.
    """

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"

    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="whatif_runs",
    )
    served_model = models.ForeignKey(
        ServedModel,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="whatif_runs",
    )
    trace_name = models.CharField(
        max_length=50, blank=True, default="", help_text="A bundled trace; empty for an upload."
    )
    trace_filename = models.CharField(
        max_length=255, blank=True, default="", help_text="The uploaded file's name."
    )
    trace_csv = models.TextField(blank=True, default="", help_text="The uploaded CSV (≤ 5 MB).")
    settings = models.JSONField(default=dict)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    progress_message = models.CharField(max_length=500, blank=True, default="")
    error = models.TextField(blank=True, default="")
    result = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        # Moved from the benchmarking app with its table (migrations.SeparateDatabaseAndState).
        db_table = "benchmarking_whatifrun"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"what-if {self.pk} on {self.trace_label} ({self.status})"

    @property
    def trace_label(self) -> str:
        return self.trace_filename or self.trace_name or "?"

    @property
    def reserved_total(self) -> float | None:
        """Σ reserved MU/min of the what-if (None without reservations)."""
        return sum((self.settings or {}).get("reservations", {}).values()) or None

    @property
    def finished(self) -> bool:
        return self.status in (self.Status.SUCCEEDED, self.Status.FAILED)

    @property
    def progress_percent(self) -> int:
        return round(100 * self.progress_done / self.progress_total) if self.progress_total else 0
