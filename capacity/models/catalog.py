from decimal import Decimal

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Q


class GpuType(models.Model):
    """A kind of accelerator, e.g. H100-80GB, with what an hour of one costs."""

    # serves: GPU type by name: API /gpu-types/{name}, seed_demo
    name = models.CharField(max_length=100, unique=True)
    memory_gb = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    hourly_cost_usd = models.DecimalField(
        max_digits=10, decimal_places=4, validators=[MinValueValidator(Decimal("0"))]
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(memory_gb__gte=1), name="gputype_memory_positive"),
            models.CheckConstraint(
                condition=Q(hourly_cost_usd__gte=0), name="gputype_cost_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class GpuPool(models.Model):
    """GPUs of one type in one cluster or region: the inventory the allocator may use.

    Deployments share their pool; the allocator never places more GPUs than `gpu_count`.
    """

    # serves: pool by name: API /gpu-pools/{name}, gpu_pool_usage_by_name's order
    name = models.CharField(max_length=100, unique=True, help_text="Cluster or region name.")
    gpu_type = models.ForeignKey(GpuType, on_delete=models.PROTECT, related_name="pools")
    gpu_count = models.PositiveIntegerField()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.gpu_count}× {self.gpu_type.name})"


class ServedModel(models.Model):
    """A model the fleet serves and sells in its own MU (docs/design.md#the-currency)."""

    # serves: model by name: API /models/{name}, admission._model, planner pages
    name = models.SlugField(max_length=100, unique=True)
    engine_model_id = models.CharField(
        max_length=200, help_text="The id the engine serves it under, e.g. meta-llama/Llama-3.1-8B."
    )
    parameters_billions = models.FloatField(validators=[MinValueValidator(0.0)])
    reference_gpu_type = models.ForeignKey(
        GpuType, on_delete=models.PROTECT, related_name="reference_for"
    )
    context_length_tokens = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    # Selling: sellable = deployable MU/min × (1 − headroom) × overcommit (planners set both).
    headroom = models.FloatField(
        default=0.1, help_text="Share of deployable capacity kept unsold, in [0, 1)."
    )
    overcommit = models.FloatField(
        default=1.0, help_text="How many MU are sold per deployable MU (> 0; 1.5 = 50 % over)."
    )
    # Best-effort demand (refused, waiting, beyond reservations) grows the fleet up to these
    # bounds, cheapest $/MU first (capacity.allocation.policy); null: only GPU inventory.
    best_effort_ceiling_mu_per_minute = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0)],
        help_text="Most MU/min of best-effort capacity the fleet plans and lends; empty: no bound.",
    )
    best_effort_ceiling_replicas = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Most replicas best-effort demand may add over all deployments; empty: no bound.",
    )
    # Rule 3c of capacity.allocation.policy: the forecast, the SLO correction and the forecast's
    # scale-down release. Off, the model is sized by the reactive rules alone.
    prediction_enabled = models.BooleanField(
        default=True,
        help_text="Size this model from its demand forecast and delivered SLO (on), or by the "
        "reactive rules alone (off).",
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(headroom__gte=0) & Q(headroom__lt=1), name="servedmodel_headroom_range"
            ),
            models.CheckConstraint(
                condition=Q(overcommit__gt=0), name="servedmodel_overcommit_positive"
            ),
            models.CheckConstraint(
                condition=Q(parameters_billions__gte=0), name="servedmodel_params_not_negative"
            ),
            models.CheckConstraint(
                condition=Q(context_length_tokens__gte=1), name="servedmodel_context_positive"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ActuatorKind(models.TextChoices):
    DRY_RUN = "dry_run", "Dry run (record only)"
    KUBERNETES = "kubernetes", "Kubernetes scale subresource"
    WEBHOOK = "webhook", "Webhook"
    PROCESS = "process", "Engine processes on a host"


class Deployment(models.Model):
    """A served model on one GPU pool: how many replicas, of what size, pushed where."""

    # serves: deployment by name: API /deployments/{name}, planner allocation and health
    name = models.SlugField(max_length=100, unique=True)
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="deployments"
    )
    gpu_pool = models.ForeignKey(GpuPool, on_delete=models.PROTECT, related_name="deployments")
    gpus_per_replica = models.PositiveIntegerField(default=1)
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=1)
    current_replicas = models.PositiveIntegerField(default=0)
    cold_start_seconds = models.PositiveIntegerField(default=120)
    scale_to_zero_after_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        default=None,
        help_text="Idle time after which the allocator may scale to zero; empty means never.",
    )
    target_utilisation = models.FloatField(
        default=0.8, help_text="Share of a replica's MU/min the allocator aims to use, in (0, 1]."
    )
    endpoint_url = models.URLField(max_length=500, blank=True, default="")
    actuator_kind = models.CharField(
        max_length=20, choices=ActuatorKind.choices, default=ActuatorKind.DRY_RUN
    )
    actuator_config = models.JSONField(default=dict, blank=True)
    # Set for a stored config that breaks the operator's rules (written before they existed,
    # or after an allow-list shrank): the tick refuses to apply it until a valid config is
    # written. Set by migration 0010 and `manage.py check_actuator_configs`; cleared by a write.
    actuator_config_problem = models.TextField(
        blank=True,
        default="",
        help_text="Why the stored actuator config is refused; empty when it is valid.",
    )
    prometheus_selector = models.CharField(
        max_length=500,
        blank=True,
        default="",
        help_text=(
            "PromQL label matchers that pick this deployment's vLLM series, e.g. "
            '\'job="vllm", namespace="prod"\'. Empty: model_name="<engine model id>".'
        ),
    )
    # The deployment's beat row (benchmarking.schedules) follows these two in the transaction that
    # writes them: ticking the flag is what schedules the run.
    benchmark_nightly = models.BooleanField(
        default=False,
        help_text="Benchmark this deployment every night, at benchmark_hour_utc, with its suite.",
    )
    benchmark_hour_utc = models.PositiveSmallIntegerField(
        default=2,
        validators=[MaxValueValidator(23)],
        help_text="The hour (0–23, UTC) the nightly benchmark starts, on the hour.",
    )
    # vLLM answers 400 to any non-zero `priority` unless started with `--scheduling-policy
    # priority`, and its default is fcfs: so probes and gateways send `priority` only when set.
    priority_scheduling = models.BooleanField(
        default=False,
        help_text=(
            "The engines run vLLM's --scheduling-policy priority: probes and gateways send "
            "`priority` to them (vLLM refuses it otherwise)."
        ),
    )
    # What runs, as observed (never as requested): the health probes' round reads it from the
    # data plane (the supervisor's replica states, the pods' readiness). Null: not observable
    # for this actuator kind, or never read.
    observed_ready_replicas = models.PositiveIntegerField(null=True, blank=True)
    observed_starting_replicas = models.PositiveIntegerField(null=True, blank=True)
    observed_draining_replicas = models.PositiveIntegerField(null=True, blank=True)
    replicas_observed_at = models.DateTimeField(null=True, blank=True)
    # Replicas a benchmark run holds (benchmarking/isolation.py): started beside the ones that
    # serve customers, taken out of the gateways' rotation, not counted as capacity; the tick's
    # target includes them, so neither the policy nor drift correction scales them away.
    benchmark_held_replicas = models.PositiveIntegerField(
        default=0, help_text="Replicas held by a running benchmark (not customer capacity)."
    )
    # What the data plane is asked to run, as the tick read it from the workload itself
    # (Kubernetes' spec.replicas, whoever set it): a difference from the target is drift.
    observed_spec_replicas = models.PositiveIntegerField(null=True, blank=True)
    # The engine's own limits, for what a cost model cannot tell (capacity.catalog.engine_profile):
    # the what-if simulates a replica with them.
    engine_profile = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            'The engine\'s parameters, e.g. {"max_num_seqs": 256, "max_num_batched_tokens": '
            '8192, "kv_cache_tokens": 200000, "context_length": 8192}; a missing one takes '
            "vLLM's default (the context length: the model's)."
        ),
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(min_replicas__lte=F("max_replicas")),
                name="deployment_min_le_max",
                violation_error_message="min_replicas must not exceed max_replicas.",
            ),
            models.CheckConstraint(
                condition=Q(gpus_per_replica__gte=1),
                name="deployment_gpus_per_replica_positive",
                violation_error_message="gpus_per_replica must be at least 1.",
            ),
            models.CheckConstraint(
                condition=Q(target_utilisation__gt=0) & Q(target_utilisation__lte=1),
                name="deployment_target_utilisation_range",
                violation_error_message="target_utilisation must be in (0, 1].",
            ),
            models.CheckConstraint(
                condition=Q(benchmark_hour_utc__lte=23),
                name="deployment_benchmark_hour_utc_range",
                violation_error_message="benchmark_hour_utc must be an hour of the day, 0 to 23.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def benchmark_suite(self) -> models.Model | None:
        """The suite the nightly benchmark runs, or None. A reference benchmarking owns
        (benchmarking.DeploymentSuite: benchmark data points at the catalogue, never the
        reverse), read back through its reverse relation; a write sets it through
        capacity.hooks.deployment_written."""
        link = getattr(self, "benchmark_suite_link", None)
        return None if link is None else link.suite

    @property
    def max_gpus(self) -> int:
        return self.max_replicas * self.gpus_per_replica
