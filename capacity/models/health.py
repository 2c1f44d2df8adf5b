"""Runtime health of the data plane: replicas, their inference probes, incidents, and the
degradation policies that apply while healthy capacity is short (capacity.health.probes,
capacity.health.degradation)."""

from django.db import models
from django.db.models import Q

from capacity.models.catalog import Deployment, ServedModel


class Replica(models.Model):
    """One engine endpoint the probes check: a process on a host, a pod, or (when replicas
    cannot be told apart) the deployment's endpoint as a whole."""

    class State(models.TextChoices):
        HEALTHY = "healthy", "Healthy"
        UNHEALTHY = "unhealthy", "Unhealthy (being replaced)"
        # Chosen to go in a scale-down (capacity/actuation/drain.py): gateways route nothing
        # new to it while it finishes what it serves; one the platform kept serves again.
        DRAINING = "draining", "Draining (leaving in a scale-down)"
        GONE = "gone", "Gone (no longer running)"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replicas")
    key = models.CharField(max_length=200, help_text="process:<index>, pod:<name> or endpoint.")
    url = models.URLField(max_length=500)
    state = models.CharField(max_length=10, choices=State.choices, default=State.HEALTHY)
    consecutive_failures = models.PositiveIntegerField(default=0)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_ok_at = models.DateTimeField(null=True, blank=True)
    last_latency_ms = models.FloatField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    # Real traffic: the engine's own request counter, and when it last moved.
    completions_total = models.FloatField(null=True, blank=True)
    completions_moved_at = models.DateTimeField(null=True, blank=True)
    # Taken out of the gateways' rotation for a benchmark run (its id: benchmarking may not be
    # referenced from here, the dependency order); null: serves customers.
    held_by_benchmark_run_id = models.PositiveIntegerField(null=True, blank=True)
    # The engine's requests in flight at the last probe (vllm:num_requests_running): a
    # scale-down removes the least loaded first.
    running_requests = models.FloatField(null=True, blank=True)
    failing_since = models.DateTimeField(null=True, blank=True)
    unhealthy_since = models.DateTimeField(null=True, blank=True)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment_id", "key"]
        constraints = [
            # serves: a deployment's replicas by key (deployments_with_replicas_by_name, API list)
            models.UniqueConstraint(fields=["deployment", "key"], name="replica_unique_key")
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.key}"


class DeploymentFingerprint(models.Model):
    """The answer a deployment gave to the probe when it was last known good. A replica that
    answers differently has corrupted weights or serves the wrong model."""

    deployment = models.OneToOneField(
        Deployment, on_delete=models.CASCADE, related_name="probe_fingerprint"
    )
    prompt = models.TextField()
    answer = models.TextField()
    answer_sha256 = models.CharField(max_length=64)
    recorded_at = models.DateTimeField()
    recorded_from = models.CharField(max_length=200, blank=True, default="")

    def __str__(self) -> str:
        return f"{self.deployment.name}: {self.answer_sha256[:12]}"


class ProbeOutcome(models.TextChoices):
    OK = "ok", "Answered as when known good"
    SKIPPED = "skipped", "Skipped: real requests completed recently"
    TIMEOUT = "timeout", "Timed out"
    ERROR = "error", "Error"
    WRONG_OUTPUT = "wrong_output", "Wrong output"


class ProbeResult(models.Model):
    """One probe: its latency and outcome (kept HEALTH_PROBE_HISTORY_HOURS)."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="probes")
    at = models.DateTimeField()
    outcome = models.CharField(max_length=12, choices=ProbeOutcome.choices)
    latency_ms = models.FloatField(null=True, blank=True)
    detail = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            # serves: a replica's probes newest first (admin; the cascade from Replica)
            models.Index(fields=["replica", "-at"]),
            # serves: capacity.health.probe_round's delete of probes older than the history
            models.Index(fields=["at"]),
        ]

    def __str__(self) -> str:
        return f"{self.replica_id} {self.outcome} at {self.at:%H:%M:%S}"


class Incident(models.Model):
    """A replica found unhealthy, from detection through restart to serving again."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="incidents")
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="incidents")
    cause = models.CharField(max_length=12, choices=ProbeOutcome.choices)
    detail = models.TextField(blank=True, default="")
    detected_at = models.DateTimeField()
    restart_requested_at = models.DateTimeField(null=True, blank=True)
    restart_error = models.TextField(blank=True, default="")
    ready_at = models.DateTimeField(
        null=True, blank=True, help_text="When the replica (or its replacement) served again."
    )
    ended_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Closed: ready again, or the replica is gone without coming back.",
    )

    class Meta:
        ordering = ["-detected_at", "-id"]
        constraints = [
            # At most one open incident per replica.
            # serves: capacity.health: a replica's open incident (ended_at IS NULL)
            models.UniqueConstraint(
                fields=["replica"], condition=Q(ended_at__isnull=True), name="incident_one_open_v2"
            )
        ]

    def __str__(self) -> str:
        return f"{self.replica} {self.cause} at {self.detected_at:%Y-%m-%d %H:%M:%S}"

    @property
    def seconds_to_ready(self) -> float | None:
        if self.ready_at is None:
            return None
        return (self.ready_at - self.detected_at).total_seconds()


class IncidentStep(models.Model):
    """Every step of an incident, timestamped: detected, restart requested, restart failed,
    ready."""

    class Step(models.TextChoices):
        FIRST_FAILURE = "first_failure", "First failed probe"
        DETECTED = "detected", "Marked unhealthy"
        RESTART_REQUESTED = "restart_requested", "Restart requested"
        RESTART_FAILED = "restart_failed", "Restart failed"
        READY = "ready", "Serving again"
        REPLACED = "replaced", "Replaced by a new replica that serves"
        GONE = "gone", "Gone without coming back"

    incident = models.ForeignKey(Incident, on_delete=models.CASCADE, related_name="steps")
    step = models.CharField(max_length=20, choices=Step.choices)
    at = models.DateTimeField()
    detail = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["incident_id", "at", "id"]

    def __str__(self) -> str:
        return f"{self.incident_id} {self.step} at {self.at:%H:%M:%S}"


class DegradationPolicy(models.Model):
    """What a model does while its healthy capacity is short, set by planners.

    Healthy capacity is the share of the replicas the allocator runs for the model that pass
    their probes. Below `degrade_below` for `window_seconds` without a break, the next level
    applies (1: refuse best-effort traffic, 2: cap max_tokens, 3: send refused requests to the
    fallback model); at or above `recover_at` for `hysteresis_seconds`, the last level is
    lifted. One bad sample never changes anything.
    """

    served_model = models.OneToOneField(
        ServedModel, on_delete=models.CASCADE, related_name="degradation_policy"
    )
    enabled = models.BooleanField(default=True)
    degrade_below = models.FloatField(
        default=0.75, help_text="Healthy share of capacity under which the model degrades."
    )
    recover_at = models.FloatField(
        default=0.9, help_text="Healthy share at or above which levels are lifted (≥ degrade)."
    )
    window_seconds = models.PositiveIntegerField(default=60)
    hysteresis_seconds = models.PositiveIntegerField(default=180)
    max_tokens_cap = models.PositiveIntegerField(
        null=True, blank=True, help_text="Level 2: admitted requests get at most this max_tokens."
    )
    fallback_model = models.ForeignKey(
        ServedModel,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="Level 3: refused requests are told to use this model instead.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["served_model__name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(degrade_below__gt=0)
                & Q(degrade_below__lte=1)
                & Q(recover_at__gte=models.F("degrade_below"))
                & Q(recover_at__lte=1),
                name="degradation_thresholds_ordered",
                violation_error_message="Need 0 < degrade_below ≤ recover_at ≤ 1.",
            )
        ]

    def __str__(self) -> str:
        return f"degradation policy of {self.served_model}"


class DegradationState(models.Model):
    """Where a model stands now; changed only by capacity.health.degradation.evaluate."""

    served_model = models.OneToOneField(
        ServedModel, on_delete=models.CASCADE, related_name="degradation_state"
    )
    level = models.PositiveSmallIntegerField(default=0)
    # At level 1: how many tiers, in shed order, have their best-effort refused (one more per
    # window, accounts.Tier.shed_order); 0 at level 1 (a state set by hand) counts as one.
    tiers_shed = models.PositiveSmallIntegerField(default=0)
    healthy_share = models.FloatField(null=True, blank=True)
    below_since = models.DateTimeField(null=True, blank=True)
    above_since = models.DateTimeField(null=True, blank=True)
    changed_at = models.DateTimeField(null=True, blank=True)
    evaluated_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.served_model} level {self.level}"


class DegradationChange(models.Model):
    """Every change of level, with its reason."""

    served_model = models.ForeignKey(
        ServedModel, on_delete=models.CASCADE, related_name="degradation_changes"
    )
    at = models.DateTimeField()
    from_level = models.PositiveSmallIntegerField()
    to_level = models.PositiveSmallIntegerField()
    healthy_share = models.FloatField()
    reason = models.TextField()

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.served_model} {self.from_level}→{self.to_level} at {self.at:%H:%M:%S}"
