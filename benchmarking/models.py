from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from capacity.models import CostModel, Deployment, GpuType, ServedModel


class BenchmarkSuite(models.Model):
    """What to measure: a grid of request shapes, a latency SLO and how hard to push."""

    # serves: suite by name: API /benchmark-suites/{name}, runs' suite field, run_benchmark
    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True, default="")
    grid = models.JSONField(
        help_text=(
            "Request shapes: [input_len, output_len], or {input_len, output_len, prefix_share, "
            "images} for prompts sharing a prefix and requests with images."
        )
    )
    slo_ttft_p95_ms = models.FloatField(validators=[MinValueValidator(0.001)])
    slo_tpot_p95_ms = models.FloatField(validators=[MinValueValidator(0.001)])
    duration_per_point_seconds = models.FloatField(
        default=20.0, validators=[MinValueValidator(0.1)]
    )
    concurrency_start = models.PositiveIntegerField(default=1)
    max_concurrency = models.PositiveIntegerField(default=256)
    # Raising concurrency stops once throughput grows by less than this share.
    min_throughput_growth = models.FloatField(default=0.05)
    max_error_rate = models.FloatField(
        default=0.05, help_text="Share of failed requests at which a run stops as failed."
    )
    request_timeout_seconds = models.FloatField(default=120.0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(concurrency_start__gte=1)
                & Q(max_concurrency__gte=models.F("concurrency_start")),
                name="suite_concurrency_range",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class BenchmarkRun(models.Model):
    """One benchmark of one endpoint, or one imported table. Long work is this row."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"

    class Source(models.TextChoices):
        RUNNER = "runner", "Measured by the load runner"
        IMPORT = "import", "Imported from a CSV"

    suite = models.ForeignKey(
        BenchmarkSuite, on_delete=models.PROTECT, null=True, blank=True, related_name="runs"
    )
    deployment = models.ForeignKey(
        Deployment, on_delete=models.SET_NULL, null=True, blank=True, related_name="benchmark_runs"
    )
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="benchmark_runs"
    )
    gpu_type = models.ForeignKey(GpuType, on_delete=models.PROTECT, related_name="benchmark_runs")
    gpus_per_replica = models.PositiveIntegerField(default=1)
    replicas = models.PositiveIntegerField(
        default=1, help_text="Replicas behind the endpoint; throughput is divided by this."
    )
    endpoint_url = models.URLField(max_length=500, blank=True, default="")
    # Measured on replicas held for the run, out of the customers' rotation
    # (benchmarking/isolation.py); False: an explicit endpoint the planner gave.
    isolated = models.BooleanField(default=False)
    measured_endpoints = models.JSONField(
        default=list, blank=True, help_text="The replicas' own URLs the run measured."
    )
    # The client's own overhead (its event loop's mean lag) and its share of the TTFT it
    # measured, worst over the sustainable points; above BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT
    # the run is unreliable and never fitted.
    client_overhead_ms = models.FloatField(null=True, blank=True)
    client_overhead_share = models.FloatField(null=True, blank=True)
    reliable = models.BooleanField(null=True, help_text="Null: not judged (no samples).")
    engine_model_id = models.CharField(max_length=200, blank=True, default="")
    source = models.CharField(max_length=10, choices=Source.choices, default=Source.RUNNER)
    source_detail = models.CharField(max_length=500, blank=True, default="")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    progress_message = models.CharField(max_length=500, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    log = models.TextField(blank=True, default="")
    fit_error = models.TextField(
        blank=True, default="", help_text="Why the fit after a successful run did not happen."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        # serves: benchmarking.services.runs_reap_stale (running, heartbeat_at < cutoff)
        indexes = [models.Index(fields=["status", "heartbeat_at"])]

    def __str__(self) -> str:
        return f"run {self.pk} {self.served_model} on {self.gpu_type} ({self.status})"

    @property
    def progress_fraction(self) -> float:
        return self.progress_done / self.progress_total if self.progress_total else 0.0


class BenchmarkSample(models.Model):
    """One measured point: a request shape at one concurrency.

    `sustainable` marks, per shape, the point the run settled on: the highest throughput that
    met the SLO. Fits use only those.
    """

    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="samples")
    input_len = models.PositiveIntegerField()
    output_len = models.PositiveIntegerField()
    # Of input_len (the prompt tokens the engine counted), those its prefix cache served.
    cached_input_len = models.PositiveIntegerField(default=0)
    images = models.PositiveIntegerField(default=0, help_text="Images per request.")
    concurrency = models.PositiveIntegerField(null=True, blank=True)
    requests_per_s = models.FloatField(help_text="Per replica.")
    input_tokens_per_s = models.FloatField(default=0.0)
    output_tokens_per_s = models.FloatField(default=0.0)
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    tpot_p50_ms = models.FloatField(null=True, blank=True)
    tpot_p95_ms = models.FloatField(null=True, blank=True)
    e2e_p95_ms = models.FloatField(null=True, blank=True)
    request_count = models.PositiveIntegerField(default=0)
    error_count = models.PositiveIntegerField(default=0)
    slo_met = models.BooleanField(default=True)
    sustainable = models.BooleanField(default=False)
    # Mean TTFT as the runner saw it and as the engines measured it (their own histogram), and
    # the runner's own event-loop lag over the point (what the client added to each TTFT).
    client_ttft_mean_ms = models.FloatField(null=True, blank=True)
    engine_ttft_mean_ms = models.FloatField(null=True, blank=True)
    client_lag_mean_ms = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run_id", "input_len", "output_len", "concurrency"]
        constraints = [
            models.CheckConstraint(
                condition=Q(requests_per_s__gte=0), name="sample_rps_not_negative"
            ),
            # serves: sustainable_samples_of_run and the fit (a run's sustainable samples)
            models.UniqueConstraint(
                fields=["run", "input_len", "output_len", "cached_input_len", "images"],
                condition=Q(sustainable=True),
                name="sample_one_sustainable_per_shape",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.input_len}/{self.output_len} @ {self.concurrency}: {self.requests_per_s:.3g}/s"
        )


# References benchmarking owns into the catalogue (benchmarking/references.py): benchmark data
# points at capacity's rows, never the reverse (docs/architecture.md: the dependency order,
# which the schema follows). Capacity reads them back through the reverse relations.


class DeploymentSuite(models.Model):
    """The suite a deployment's nightly benchmark runs (at most one per deployment); read as
    `Deployment.benchmark_suite`, set through the deployment's API field `benchmark_suite`."""

    deployment = models.OneToOneField(
        Deployment,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="benchmark_suite_link",
    )
    # A deleted suite leaves its deployments without one, as a null reference did.
    suite = models.ForeignKey(
        BenchmarkSuite, on_delete=models.CASCADE, related_name="deployment_links"
    )

    def __str__(self) -> str:
        return f"{self.deployment_id} runs {self.suite_id}"


class CostModelSource(models.Model):
    """The run a cost model version was fitted from; read as `CostModel.source_run`."""

    cost_model = models.OneToOneField(
        CostModel, on_delete=models.CASCADE, primary_key=True, related_name="source_link"
    )
    # A deleted run leaves its versions without a source, as a null reference did.
    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="cost_model_links")

    def __str__(self) -> str:
        return f"cost model {self.cost_model_id} from run {self.run_id}"
