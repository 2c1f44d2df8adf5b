"""Rate cards (versioned prices per served model) and invoices with their lines.

Money is `Decimal`. Rounding is stated once (`billing.money`): every line's amount is rounded
to the currency's cents, half up, when the line is made; totals are sums of rounded lines.
"""

from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from accounts.models import ApiKey, Customer
from capacity.models import Reservation, ServedModel

ZERO = Decimal("0")


class RateCard(models.Model):
    """The prices of one served model from `effective_from` until the next version's date.

    A version that an issued invoice has used is never edited: a new version takes effect at
    its own date (billing.rates.rate_card_create)."""

    served_model = models.ForeignKey(ServedModel, on_delete=models.PROTECT, related_name="+")
    effective_from = models.DateTimeField()
    currency = models.CharField(max_length=3, default="USD")
    reserved_price_per_mu_minute_hour = models.DecimalField(
        max_digits=14,
        decimal_places=6,
        validators=[MinValueValidator(ZERO)],
        help_text="Price of 1 MU/min reserved for one hour.",
    )
    best_effort_price_per_1000_mu = models.DecimalField(
        max_digits=14, decimal_places=6, validators=[MinValueValidator(ZERO)]
    )
    # Keep-warm holds a reservation's replicas hot even while it is idle, where one without it
    # may go cold and pay a cold start: the GPUs it holds idle are priced on top.
    keep_warm_price_per_mu_minute_hour = models.DecimalField(
        max_digits=14,
        decimal_places=6,
        default=ZERO,
        validators=[MinValueValidator(ZERO)],
        help_text="Premium of 1 MU/min reserved with keep-warm for one hour, on top of the "
        "reserved price (0: keep-warm is not charged).",
    )
    # The latency SLA (billing.latency): the share of guaranteed requests whose first token
    # comes within the objective, per customer and month, and the credit each shortfall earns.
    ttft_objective_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Time-to-first-token objective of guaranteed requests, in ms (empty: no "
        "latency SLA).",
    )
    latency_credit_tiers = models.JSONField(
        default=list,
        blank=True,
        help_text='Attainment to credit, e.g. [{"below_attainment_percent": 99, '
        '"credit_percent": 10}, {"below_attainment_percent": 95, "credit_percent": 25}]: '
        "below 99 % of guaranteed requests within the objective, 10 % of the month's "
        "commitment is credited; below 95 %, 25 %.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["served_model__name", "effective_from"]
        constraints = [
            # serves: billing.rates.cards_by_model (a model's cards by effective_from)
            models.UniqueConstraint(
                fields=["served_model", "effective_from"], name="rate_card_one_per_date"
            )
        ]

    def __str__(self) -> str:
        return f"{self.served_model} from {self.effective_from:%Y-%m-%d %H:%M}"


class Invoice(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        ISSUED = "issued", "Issued"
        VOID = "void", "Void"

    customer = models.ForeignKey(Customer, on_delete=models.PROTECT, related_name="invoices")
    period_start = models.DateField(help_text="The first day of the month billed.")
    status = models.CharField(max_length=6, choices=Status.choices, default=Status.DRAFT)
    currency = models.CharField(max_length=3)
    subtotal = models.DecimalField(max_digits=16, decimal_places=2, default=ZERO)
    credits = models.DecimalField(max_digits=16, decimal_places=2, default=ZERO)
    total = models.DecimalField(max_digits=16, decimal_places=2, default=ZERO)
    generated_at = models.DateTimeField()
    issued_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-period_start", "customer__slug"]
        constraints = [
            # One live invoice per customer, month and currency; void ones are kept beside it.
            # serves: generation._store_drafts; billing.selectors.recent_invoices_of_customer
            models.UniqueConstraint(
                fields=["customer", "period_start", "currency"],
                condition=~Q(status="void"),
                name="invoice_one_live_per_period",
            )
        ]

    def __str__(self) -> str:
        return f"{self.customer} {self.period_start:%Y-%m} ({self.status})"


class InvoiceLine(models.Model):
    class Kind(models.TextChoices):
        COMMITMENT = "commitment", "Commitment"
        KEEP_WARM = "keep_warm", "Keep-warm premium"
        BEST_EFFORT = "best_effort", "Best-effort usage"
        CREDIT = "credit", "SLA credit"
        ADJUSTMENT = "adjustment", "Adjustment"
        # The latency SLA's attainment when no credit is due (billing.latency): 0.00.
        LATENCY_SLA = "latency_sla", "Latency SLA (no credit due)"

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    kind = models.CharField(max_length=11, choices=Kind.choices)
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    reservation = models.ForeignKey(
        Reservation, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    rate_card = models.ForeignKey(
        RateCard, on_delete=models.PROTECT, null=True, blank=True, related_name="lines"
    )
    description = models.CharField(max_length=300)
    starts_at = models.DateTimeField(null=True, blank=True)
    ends_at = models.DateTimeField(null=True, blank=True)
    quantity = models.DecimalField(max_digits=20, decimal_places=6)
    unit = models.CharField(max_length=40)
    unit_price = models.DecimalField(max_digits=14, decimal_places=6)
    amount = models.DecimalField(max_digits=16, decimal_places=2)
    evidence = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["invoice", "kind", "pk"]

    def __str__(self) -> str:
        return f"{self.invoice}: {self.description}"


class Budget(models.Model):
    """A monthly budget of a customer (`api_key` empty) or of one of its keys (billing.budgets).

    A customer's month-to-date spend is what its invoice for the month holds so far
    (billing.generation.build_lines, the invoice's own lines); a key's is what the requests
    sent with it were billed beyond the reservations (their best-effort MU, from the key
    rollups, at the rate cards' best-effort price, as the invoice's best-effort lines price
    them; the commitment is the customer's, not a key's). Both in the budget's currency.
    Alerts go at 50, 80 and 100 % of it, once each per month; with `hard_cap`, past 100 %
    admission refuses the best-effort requests of the customer, or of the key."""

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="budgets")
    api_key = models.ForeignKey(
        ApiKey,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="budgets",
        help_text="Empty: the customer's budget, over all its keys. A key's budget counts the "
        "requests sent with that key.",
    )
    monthly_amount = models.DecimalField(
        max_digits=16, decimal_places=2, validators=[MinValueValidator(Decimal("0.01"))]
    )
    currency = models.CharField(
        max_length=3, default="USD", help_text="The rate cards' currency whose lines count."
    )
    hard_cap = models.BooleanField(
        default=False,
        help_text="Past 100 % of the budget, refuse best-effort requests of the customer (or of "
        "the key); requests within the reservation are still admitted.",
    )
    alert_email = models.EmailField(
        blank=True, help_text="Where alerts are mailed; empty: the customer's owners."
    )
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["customer__slug", "pk"]
        constraints = [
            # serves: billing.budgets.budget_create (one customer-wide budget)
            models.UniqueConstraint(
                fields=["customer"],
                condition=Q(api_key__isnull=True),
                name="budget_one_per_customer",
            ),
            # serves: billing.budgets.budget_create (one budget per key)
            models.UniqueConstraint(fields=["api_key"], name="budget_one_per_key"),
        ]

    def __str__(self) -> str:
        whose = f"{self.customer} key {self.api_key.prefix}" if self.api_key_id else self.customer
        return f"{whose}: {self.monthly_amount} {self.currency}/month"


class BudgetAlert(models.Model):
    """One alert, on one channel: written (inserted) before it is sent, sent after the commit,
    so the unique constraints, not the senders, decide that an alert goes at most once per
    threshold and period whatever the number of concurrent checks."""

    class Kind(models.TextChoices):
        BUDGET = "budget", "Budget threshold"
        UNDERUSE = "underuse", "Reservation under-used for a week (sale at risk)"

    class Channel(models.TextChoices):
        EMAIL = "email", "Email"
        WEBHOOK = "webhook", "Signed webhook"

    kind = models.CharField(max_length=8, choices=Kind.choices)
    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="+")
    budget = models.ForeignKey(
        Budget, on_delete=models.CASCADE, null=True, blank=True, related_name="alerts"
    )
    reservation = models.ForeignKey(
        Reservation, on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    period = models.CharField(max_length=7, help_text="The month alerted for, YYYY-MM.")
    threshold_percent = models.PositiveSmallIntegerField(
        help_text="Of the budget (50, 80, 100), or the utilisation alerted under (20)."
    )
    channel = models.CharField(max_length=7, choices=Channel.choices)
    recipients = models.CharField(max_length=1000, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-created_at", "pk"]
        constraints = [
            # serves: billing.budgets._claim (an insert that conflicts is an alert already sent)
            models.UniqueConstraint(
                fields=["budget", "period", "threshold_percent", "channel"],
                condition=Q(budget__isnull=False),
                name="budget_alert_once_per_threshold",
            ),
            models.UniqueConstraint(
                fields=["reservation", "period", "threshold_percent", "channel"],
                condition=Q(reservation__isnull=False),
                name="underuse_alert_once_per_period",
            ),
            models.CheckConstraint(
                condition=(Q(kind="budget", budget__isnull=False, reservation__isnull=True))
                | Q(kind="underuse", budget__isnull=True, reservation__isnull=False),
                name="budget_alert_names_its_subject",
            ),
        ]

    def __str__(self) -> str:
        subject = (
            f"budget #{self.budget_id}" if self.budget_id else f"reservation #{self.reservation_id}"
        )
        return f"{self.kind} {subject} {self.period} {self.threshold_percent} % by {self.channel}"
