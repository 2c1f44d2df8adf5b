from django.db import models

from accounts.models import Customer
from capacity.models.catalog import Deployment, ServedModel


class AllocationDecision(models.Model):
    """What one tick decided for one deployment, why, and what the actuator made of it."""

    # serves: one tick's decisions by tick_id (ad hoc; no code path filters on it today)
    tick_id = models.UUIDField(db_index=True)
    deployment = models.ForeignKey(
        Deployment, on_delete=models.CASCADE, related_name="allocation_decisions"
    )
    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="+")
    # serves: decisions by -created_at (API list, decisions_newest_first), billing.margin
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    inputs_digest = models.CharField(max_length=64, help_text="SHA-256 of the model's snapshot.")
    current_replicas = models.PositiveIntegerField()
    recommended_replicas = models.PositiveIntegerField()
    target_replicas = models.PositiveIntegerField()
    reasons = models.JSONField(default=list)
    dry_run = models.BooleanField(default=False)
    actuator_kind = models.CharField(max_length=20)
    actuator_ok = models.BooleanField(null=True, help_text="Null: not applied (unchanged).")
    actuator_attempts = models.PositiveIntegerField(default=0)
    actuator_error = models.TextField(blank=True, default="")
    observed_replicas = models.PositiveIntegerField(null=True, blank=True)
    # The workload's own count when the tick read it (Kubernetes' spec.replicas), before any
    # push: a difference from current_replicas is drift the tick corrected (reason
    # drift_corrected), or the HPA's own choice in hpa-bounds mode.
    observed_spec_replicas = models.PositiveIntegerField(null=True, blank=True)
    applied_at = models.DateTimeField(null=True, blank=True)
    # Of current_replicas when the tick decided, as observed: serving, loading, leaving.
    ready_replicas = models.PositiveIntegerField(null=True, blank=True)
    starting_replicas = models.PositiveIntegerField(null=True, blank=True)
    draining_replicas = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        # serves: latest_decision_per_deployment, replica_counts_per_step (one deployment)
        indexes = [models.Index(fields=["deployment", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.deployment} → {self.target_replicas} at {self.created_at:%H:%M:%S}"


class AdmissionAllowance(models.Model):
    """The latest tick's admission limits for one customer and model (docs/design.md#the-tick)."""

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="allowances")
    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="+")
    guaranteed_mu_per_minute = models.FloatField()
    best_effort_mu_per_minute = models.FloatField()
    tick_id = models.UUIDField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["customer__slug", "served_model__name"]
        constraints = [
            # serves: admission._reserved_mu_per_minute (allowance of customer × model)
            models.UniqueConstraint(
                fields=["customer", "served_model"], name="allowance_unique_customer_model"
            )
        ]

    def __str__(self) -> str:
        return f"{self.customer} {self.served_model}"


class ActuatorCircuit(models.Model):
    """Repeated actuator failures open a circuit: the deployment is left alone for a while
    instead of being hammered every tick."""

    deployment = models.OneToOneField(
        Deployment, on_delete=models.CASCADE, related_name="actuator_circuit"
    )
    consecutive_failures = models.PositiveIntegerField(default=0)
    opened_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.deployment}: {self.consecutive_failures} failures"


class TickHeartbeat(models.Model):
    """The allocation loop's pulse: one row, written by every tick that completes
    (capacity.allocation.heartbeat). /readyz, /metrics and the planner's pages read its age;
    the health worker watches it and alerts when the tick goes stale and when it recovers."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    ticked_at = models.DateTimeField(help_text="When the last tick completed.")
    tick_id = models.UUIDField()
    tick_seconds = models.FloatField(default=0.0, help_text="How long that tick took.")
    # Set by the watcher while the tick is stale (its alert "entered" was sent), cleared with
    # the alert "left".
    stale_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(id=1), name="tick_heartbeat_single_row")
        ]

    def __str__(self) -> str:
        return f"tick at {self.ticked_at:%Y-%m-%d %H:%M:%S}"
