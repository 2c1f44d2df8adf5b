from django.db import models
from django.db.models import Q

from capacity.currency import REPLICA_MU_PER_MINUTE
from capacity.models.catalog import GpuType, ServedModel


class CostModel(models.Model):
    """A fitted cost model for one (served model, GPU type, GPUs per replica)
    (docs/design.md#the-currency).

    `weights_replica_seconds` maps each feature to the replica-seconds one unit of it costs on
    a saturated replica. MU coefficients follow from `replica_mu_per_minute` (R = 100 by
    definition on the model's reference GPU type): MU per unit = weight × R / 60.
    Versions are never edited after the fit: usage stores the version it was priced with.
    """

    class Status(models.TextChoices):
        CANDIDATE = "candidate", "Candidate"
        ACTIVE = "active", "Active"
        RETIRED = "retired", "Retired"
        # A planner reviewed its price change and turned it down: it never activates itself.
        REJECTED = "rejected", "Rejected"

    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="cost_models"
    )
    gpu_type = models.ForeignKey(GpuType, on_delete=models.PROTECT, related_name="cost_models")
    gpus_per_replica = models.PositiveIntegerField(default=1)
    version = models.PositiveIntegerField()
    features = models.JSONField(help_text="Feature names the fit selected.")
    weights_replica_seconds = models.JSONField()
    replica_mu_per_minute = models.FloatField(default=REPLICA_MU_PER_MINUTE)
    alpha_mu_per_input_token = models.FloatField()
    beta_mu_per_output_token = models.FloatField()
    gamma_mu_per_request = models.FloatField()
    mu_per_unit = models.JSONField(help_text="MU per unit of every feature.")
    sample_count = models.PositiveIntegerField()
    distinct_shapes = models.PositiveIntegerField()
    cv_mape = models.FloatField(
        help_text="Cross-validated mean absolute percentage error (0.05 = 5 %)."
    )
    cv_worst_error = models.FloatField()
    cv_error_by_feature = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            "The held-out error over the samples carrying each feature: "
            '{"cached_input_tokens" | "images": {"cv_mape", "cv_worst_error", "samples"}}, '
            "for the features some benchmarked shape had."
        ),
    )
    candidates = models.JSONField(default=list, help_text="Every feature set tried, with its CV.")
    residuals = models.JSONField(default=list)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.CANDIDATE)
    created_at = models.DateTimeField(auto_now_add=True)
    activated_at = models.DateTimeField(null=True, blank=True)
    retired_at = models.DateTimeField(null=True, blank=True)
    # The review (capacity.pricing.review): how the fit moved prices against the version active
    # when it was recorded, and why it waits for a planner when it did not activate itself.
    price_change = models.JSONField(
        null=True,
        blank=True,
        help_text=(
            "How this version moved prices, when it was fitted, against the version then active: "
            "the share by which it changes the total MU of the last days' traffic (or of the "
            "benchmark's shapes when there was none), without per-customer figures."
        ),
    )
    review_reason = models.CharField(
        max_length=500,
        blank=True,
        default="",
        help_text="Why this version did not activate itself; empty when it did.",
    )
    # Who put it in force (audit actor: "user:<name>", "key:<prefix> (<owner>)" or
    # "system:auto") and why, for its latest activation; the audit log keeps every one.
    approved_by = models.CharField(max_length=200, blank=True, default="")
    approval_reason = models.CharField(max_length=2000, blank=True, default="")
    rejected_at = models.DateTimeField(null=True, blank=True)
    rejected_by = models.CharField(max_length=200, blank=True, default="")
    rejection_reason = models.CharField(max_length=2000, blank=True, default="")

    class Meta:
        ordering = ["served_model__name", "gpu_type__name", "gpus_per_replica", "-version"]
        constraints = [
            # serves: pricing_selectors.cost_model_versions and cost_model_groups
            models.UniqueConstraint(
                fields=["served_model", "gpu_type", "gpus_per_replica", "version"],
                name="costmodel_unique_version",
            ),
            # One active version per (model, GPU type, GPUs per replica), enforced by the database
            # so two concurrent activations cannot both win.
            # serves: active_cost_model, active_cost_models_of_groups, group_has_active_version
            models.UniqueConstraint(
                fields=["served_model", "gpu_type", "gpus_per_replica"],
                condition=Q(status="active"),
                name="costmodel_one_active",
            ),
            models.CheckConstraint(
                condition=Q(replica_mu_per_minute__gt=0), name="costmodel_r_positive"
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.served_model.name} on {self.gpu_type.name}×{self.gpus_per_replica} "
            f"v{self.version} ({self.status})"
        )

    @property
    def source_run(self) -> models.Model | None:
        """The benchmark run this version was fitted from, or None. A reference benchmarking
        owns (benchmarking.CostModelSource), read back through its reverse relation."""
        link = getattr(self, "source_link", None)
        return None if link is None else link.run

    @property
    def source_run_id(self) -> int | None:
        """The id of `source_run`, without loading the run."""
        link = getattr(self, "source_link", None)
        return None if link is None else link.run_id
