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


class Verification(models.TextChoices):
    """Where an event's admission class came from: the sender never chooses its own price."""

    RECORDED = "recorded", "Admission record"
    FALLBACK = "fallback", "Fallback admission record (Redis was down)"
    UNRECORDED = "unrecorded", "No admission record: priced as best-effort"
    CONTRADICTED = "contradicted", "Contradicted its admission record: the record decided"
    SENDER = "sender", "Class as sent (stored before admission records decided it)"
    # No usage event ever came for an admission record (its gateway worker died holding it):
    # closed by the reaper (capacity.metering.reaper) as cancelled, or refused, at 0 MU.
    REAPED = "reaped", "Reaped: its gateway never reported it; closed at 0 MU"


class UsageEvent(models.Model):
    """One metered request, priced in MU when it arrived with the cost model then active.

    `event_id` is minted by the client (the admission `request_id`) and unique per customer,
    so a retried batch never counts twice and one tenant's ids never collide with another's.
    `admission_class` comes from the admission record of that request id (`verification`
    says which record, or why none). `rolled_up` marks events already folded into
    `UsageMinute`; late events arrive unrolled.

    Its four references (customer, model, deployment, cost model) are not foreign key
    constraints (`db_constraint=False`): PostgreSQL checks a foreign key row by row, which
    cost ingestion about as much as the COPY of the rows itself (bench_usage, issue 24). The
    database still refuses an event that references a missing row, and the delete of a row
    that events reference, taking the locks a foreign key takes, but checked once per statement
    over the statement's rows (migration 0035, docs/architecture.md).
    """

    event_id = models.CharField(max_length=100)
    customer = models.ForeignKey(
        Customer, on_delete=models.PROTECT, related_name="usage_events", db_constraint=False
    )
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="usage_events", db_constraint=False
    )
    deployment = models.ForeignKey(
        Deployment,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="usage_events",
        db_constraint=False,
    )
    # The engine endpoint that served it, as the gateway routed it: which replica did the work
    # (a benchmark's replicas must never appear here for a customer's request).
    replica = models.CharField(max_length=500, blank=True, default="", db_default="")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    minute = models.DateTimeField(help_text="finished_at truncated to the minute (UTC).")
    input_tokens = models.PositiveIntegerField()
    cached_input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField()
    images = models.PositiveIntegerField(default=0)
    outcome = models.CharField(max_length=10, choices=Outcome.choices)
    admission_class = models.CharField(max_length=12, choices=AdmissionClass.choices)
    # db_default: rows written by raw SQL (bulk loads, COPY) get them too.
    verification = models.CharField(
        max_length=12,
        choices=Verification.choices,
        default=Verification.SENDER,
        db_default=Verification.SENDER,
    )
    # Posted by a key of the customer itself (allowed per customer by a planner), not by a
    # platform gateway: shown as such on the invoice.
    self_reported = models.BooleanField(default=False, db_default=False)
    # The customer's API key the request was sent with (its prefix), as the control plane
    # recorded it when it admitted the request (the admission record), never as the sender
    # claims: empty when no record names one. What a key's budget is spent from
    # (UsageKeyMinute, billing.budgets).
    api_key_prefix = models.CharField(max_length=16, blank=True, default="", db_default="")
    # Time to first token as the gateway measured it from when the request left any hold for a
    # cold start (held_ms) to its first streamed byte. Null for a non-streamed request (its
    # first byte is its end: never a TTFT) and where the sender measured none.
    ttft_ms = models.FloatField(null=True, blank=True)
    # How long the gateway held the request for a model at zero before admitting it (its cold
    # start), kept apart from ttft_ms: the latency SLA counts it only for a customer whose
    # reservation keeps the model warm (billing.latency). Null: not held.
    held_ms = models.FloatField(null=True, blank=True)
    # Whether the response was streamed (SSE): only a streamed response has a first token
    # before its end. Null: the sender did not say.
    streamed = models.BooleanField(null=True, blank=True)
    # A completion's list of prompts runs as that many engine requests, `n` sequences each: the
    # tokens are their totals, priced as that work (capacity.pricing.features.
    # batch_replica_seconds). Null: one prompt, one sequence.
    prompts = models.PositiveIntegerField(null=True, blank=True)
    sequences = models.PositiveIntegerField(null=True, blank=True)
    mu = models.FloatField()
    # How `mu` splits between the classes it is billed in (partial spillover,
    # capacity.admission.bucket.split): what the customer's guarantee covered and what ran
    # beyond it, from the admission record (AdmissionRecord.split); they add up to `mu`. A
    # best-effort event may carry a guaranteed part: it took what was left of the guarantee.
    guaranteed_mu = models.FloatField(default=0.0, db_default=0.0)
    best_effort_mu = models.FloatField(default=0.0, db_default=0.0)
    # A refused request used nothing (mu is 0) but was demand: what it would have cost, from
    # its admission record (the control plane's own estimate), else from the sender's
    # `estimated_mu`. Null for requests that ran.
    estimated_mu = models.FloatField(null=True, blank=True)
    # The bytes of prompt text the gateway saw, sent with the engine's own input_tokens: what
    # calibrates a model's bytes per token (capacity.metering.calibration). Null when unknown.
    prompt_bytes = models.PositiveIntegerField(null=True, blank=True)
    cost_model = models.ForeignKey(
        CostModel, on_delete=models.PROTECT, related_name="+", db_constraint=False
    )
    ingested_at = models.DateTimeField()
    rolled_up = models.BooleanField(default=False)

    class Meta:
        constraints = [
            # Idempotency: a retried or concurrent duplicate of a customer's event is skipped
            # (ingestion's ON CONFLICT targets exactly these columns).
            # serves: usage_rows_insert's ON CONFLICT (customer, event_id): duplicates skipped
            models.UniqueConstraint(
                fields=["customer", "event_id"], name="usage_event_id_unique_per_customer"
            ),
            models.CheckConstraint(condition=Q(mu__gte=0), name="usage_mu_not_negative"),
            models.CheckConstraint(
                condition=Q(guaranteed_mu__gte=0, best_effort_mu__gte=0),
                name="usage_split_not_negative",
            ),
            models.CheckConstraint(
                condition=Q(cached_input_tokens__lte=models.F("input_tokens")),
                name="usage_cached_within_input",
            ),
        ]
        indexes = [
            # serves: capacity.metering.rollups: the events of each (customer, model, minute)
            # touched
            models.Index(fields=["customer", "served_model", "minute"]),
            # serves: allocation_tick._bursts (requests started in the last minutes)
            models.Index(fields=["started_at"], name="usage_started_at"),
            # serves: a customer's receipts, newest first, a page at a time: the API's keyset
            # pages (metering.selectors.usage_receipts, each page one range of this index) and
            # the portal's (usage_events_of_customer_newest_first)
            models.Index(fields=["customer", "-finished_at", "-id"], name="usage_customer_newest"),
            # serves: capacity.metering.rollups: a pass picks events not rolled up, by id
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
    # The events' guaranteed and best-effort parts (UsageEvent.guaranteed_mu, best_effort_mu).
    guaranteed_mu = models.FloatField(default=0.0)
    best_effort_mu = models.FloatField(default=0.0)
    # Of `mu`: what the customer's own keys reported, and what no admission record confirmed;
    # the invoice shows both beside the best-effort charge.
    self_reported_mu = models.FloatField(default=0.0, db_default=0.0)
    unverified_mu = models.FloatField(default=0.0, db_default=0.0)
    # The estimated MU of the minute's refused requests: demand that was turned away (not the
    # requests the customer's own request limits refused).
    refused_mu = models.FloatField(default=0.0, db_default=0.0)
    # Of refused_mu: the requests refused in the guaranteed class (over the reservation).
    guaranteed_refused_mu = models.FloatField(default=0.0, db_default=0.0)
    # Of the minute's events that ran and carried prompt_bytes: their bytes and their input
    # tokens as the engine counted them (the bytes-per-token calibration).
    prompt_bytes = models.BigIntegerField(default=0, db_default=0)
    prompt_bytes_input_tokens = models.BigIntegerField(default=0, db_default=0)

    class Meta:
        constraints = [
            # serves: rollups' upsert, customer_utilisation, usage_totals_by_customer
            models.UniqueConstraint(
                fields=["customer", "served_model", "minute"], name="usageminute_unique_key"
            ),
        ]
        # serves: capacity.metering.utilisation.used_now (a model's last five minutes)
        indexes = [models.Index(fields=["served_model", "minute"])]

    def __str__(self) -> str:
        return f"{self.customer_id}/{self.served_model_id} {self.minute:%Y-%m-%d %H:%M}"


class UsageKeyMinute(models.Model):
    """Per customer × API key × model × minute: what the requests sent with one of the
    customer's keys used, recomputed from raw events by the same rollup pass as UsageMinute
    (capacity.metering.rollups). Events without a recorded key are in UsageMinute only. What a
    key's budget is priced from (billing.budgets)."""

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="+")
    api_key_prefix = models.CharField(max_length=16)
    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="+")
    minute = models.DateTimeField()
    requests = models.PositiveIntegerField(default=0)
    refused_requests = models.PositiveIntegerField(default=0)
    mu = models.FloatField(default=0.0)
    guaranteed_mu = models.FloatField(default=0.0)
    best_effort_mu = models.FloatField(default=0.0)

    class Meta:
        constraints = [
            # serves: rollups' upsert; billing.budgets' key spend (a key's minutes of a model
            # in a rate card's window: a range of this index)
            models.UniqueConstraint(
                fields=["customer", "api_key_prefix", "served_model", "minute"],
                name="usagekeyminute_unique_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.api_key_prefix}/{self.served_model_id} {self.minute:%Y-%m-%d %H:%M}"


class FallbackAdmission(models.Model):
    """An admission decided while Redis was unreachable (ADMISSION_ON_REDIS_DOWN).

    Redis holds the admission records that decide a usage event's class; a decision made
    without Redis is spooled here instead, so its usage event is still priced by what
    admission decided rather than by what the sender claims.
    """

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="+")
    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="+")
    request_id = models.CharField(max_length=100)
    # guaranteed, best_effort, refused_guaranteed or refused (as in Redis's records).
    admission_class = models.CharField(max_length=20)
    estimated_mu = models.FloatField()
    # The customer key the request came with, as the Redis records keep it ("" for none).
    api_key_prefix = models.CharField(max_length=16, blank=True, default="", db_default="")
    decided_at = models.DateTimeField()

    class Meta:
        constraints = [
            # Ingestion looks records up by (customer, request id).
            # serves: capacity.admission.admission_records (by customer and request id)
            models.UniqueConstraint(
                fields=["customer", "request_id"], name="fallback_admission_unique_request"
            ),
        ]
        indexes = [
            # The clean-up of records older than the usage lateness window.
            # serves: capacity.admission.fallback_records_prune (decided_at < horizon)
            models.Index(fields=["decided_at"], name="fallback_admission_decided_at"),
        ]

    def __str__(self) -> str:
        return f"{self.customer_id}/{self.request_id}: {self.admission_class}"
