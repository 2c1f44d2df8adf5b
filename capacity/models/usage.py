from django.db import models
from django.db.models import Q

from accounts.models import Customer
from capacity.models.catalog import Deployment, ServedModel
from capacity.models.cost_models import CostModel


class Outcome(models.TextChoices):
    COMPLETED = "completed", "Completed"
    CANCELLED = "cancelled", "Cancelled"
    ERROR = "error", "Error"
    REFUSED = "refused", "Refused"


class AdmissionClass(models.TextChoices):
    GUARANTEED = "guaranteed", "Guaranteed"
    BEST_EFFORT = "best_effort", "Best effort"
    NONE = "none", "None"


class UsageEvent(models.Model):
    """One metered request, priced in MU when it arrived with the cost model then active.

    `event_id` is minted by the client and unique, so a retried batch never counts twice.
    `rolled_up` marks events already folded into `UsageMinute`; late events arrive unrolled.
    """

    event_id = models.CharField(max_length=100, unique=True)
    customer = models.ForeignKey(Customer, on_delete=models.PROTECT, related_name="usage_events")
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="usage_events"
    )
    deployment = models.ForeignKey(
        Deployment, on_delete=models.SET_NULL, null=True, blank=True, related_name="usage_events"
    )
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    minute = models.DateTimeField(help_text="finished_at truncated to the minute (UTC).")
    input_tokens = models.PositiveIntegerField()
    cached_input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField()
    images = models.PositiveIntegerField(default=0)
    outcome = models.CharField(max_length=10, choices=Outcome.choices)
    admission_class = models.CharField(max_length=12, choices=AdmissionClass.choices)
    ttft_ms = models.FloatField(null=True, blank=True)
    mu = models.FloatField()
    cost_model = models.ForeignKey(CostModel, on_delete=models.PROTECT, related_name="+")
    ingested_at = models.DateTimeField()
    rolled_up = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(mu__gte=0), name="usage_mu_not_negative"),
            models.CheckConstraint(
                condition=Q(cached_input_tokens__lte=models.F("input_tokens")),
                name="usage_cached_within_input",
            ),
        ]
        indexes = [
            models.Index(fields=["customer", "served_model", "minute"]),
            # The allocation tick's burst query (requests started in the last minutes).
            models.Index(fields=["started_at"], name="usage_started_at"),
            models.Index(fields=["id"], name="usage_not_rolled_up", condition=Q(rolled_up=False)),
        ]

    def __str__(self) -> str:
        return self.event_id


class UsageMinute(models.Model):
    """Per customer × model × minute: what was used, recomputed from raw events."""

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="+")
    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="+")
    minute = models.DateTimeField()
    requests = models.PositiveIntegerField(default=0)
    refused_requests = models.PositiveIntegerField(default=0)
    guaranteed_refused_requests = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    cached_input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    mu = models.FloatField(default=0.0)
    guaranteed_mu = models.FloatField(default=0.0)
    best_effort_mu = models.FloatField(default=0.0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["customer", "served_model", "minute"], name="usageminute_unique_key"
            ),
        ]
        indexes = [models.Index(fields=["served_model", "minute"])]

    def __str__(self) -> str:
        return f"{self.customer_id}/{self.served_model_id} {self.minute:%Y-%m-%d %H:%M}"
