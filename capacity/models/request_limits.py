"""Request limits: requests per minute, tokens per minute and requests in flight a customer may
have, beside its MU buckets (issue 22). Set by planners; enforced by admission and by gateways
in the same Redis round trip as the MU buckets (capacity.admission.limits, redis_buckets).

A row is either customer-wide (`api_key` empty: all the customer's requests, across its models
and keys) or for one of the customer's keys; both apply to a request sent with that key. An
empty limit is no limit. Written only by capacity.admission.limits, which audits and publishes
every change.
"""

from django.db import models
from django.db.models import Q

from accounts.models import ApiKey, Customer


class RequestLimit(models.Model):
    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="request_limits")
    api_key = models.ForeignKey(
        ApiKey,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="request_limits",
        help_text="Empty: the customer's limit, over all its keys.",
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="In any sliding 60 s window. Empty: no limit."
    )
    tokens_per_minute = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="input_tokens + max_tokens of the requests admitted in any sliding 60 s "
        "window. Empty: no limit.",
    )
    concurrent_requests = models.PositiveIntegerField(
        null=True, blank=True, help_text="Requests in flight at once. Empty: no limit."
    )
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["customer_id", "api_key_id"]
        constraints = [
            # serves: request_limit_set (one customer-wide row) and the publication's scopes
            models.UniqueConstraint(
                fields=["customer"],
                condition=Q(api_key__isnull=True),
                name="request_limit_one_per_customer",
            ),
            # serves: request_limit_set (one row per key)
            models.UniqueConstraint(fields=["api_key"], name="request_limit_one_per_key"),
            models.CheckConstraint(
                condition=Q(requests_per_minute__isnull=False)
                | Q(tokens_per_minute__isnull=False)
                | Q(concurrent_requests__isnull=False),
                name="request_limit_limits_something",
            ),
            models.CheckConstraint(
                condition=(Q(requests_per_minute__isnull=True) | Q(requests_per_minute__gte=1))
                & (Q(tokens_per_minute__isnull=True) | Q(tokens_per_minute__gte=1))
                & (Q(concurrent_requests__isnull=True) | Q(concurrent_requests__gte=1)),
                name="request_limit_at_least_one",
            ),
        ]

    def __str__(self) -> str:
        whose = f"key {self.api_key.prefix}" if self.api_key_id else "all keys"
        return f"{self.customer} ({whose})"

    @property
    def limits(self) -> dict[str, int]:
        """The limits set, by the names admission's script reads ("rpm", "tpm", "concurrency")."""
        values = {
            "rpm": self.requests_per_minute,
            "tpm": self.tokens_per_minute,
            "concurrency": self.concurrent_requests,
        }
        return {name: value for name, value in values.items() if value is not None}


class BudgetCap(models.Model):
    """A customer (`api_key` empty), or one of its keys, whose best-effort requests admission
    refuses, for the reason given: billing's hard cap on a spent monthly budget sets and lifts
    it (billing.budgets), through capacity.admission.limits.budget_cap_set, which audits and
    publishes every change. Requests within the customer's reservation are admitted as before.
    A row is a cap; no row, none."""

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="budget_caps")
    api_key = models.ForeignKey(
        ApiKey,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="budget_caps",
        help_text="Empty: the customer's cap, over all its keys.",
    )
    reason = models.CharField(max_length=300)
    since = models.DateTimeField()

    class Meta:
        constraints = [
            # serves: budget_cap_set (one customer-wide cap) and the publication's scopes
            models.UniqueConstraint(
                fields=["customer"],
                condition=Q(api_key__isnull=True),
                name="budget_cap_one_per_customer",
            ),
            # serves: budget_cap_set (one cap per key)
            models.UniqueConstraint(fields=["api_key"], name="budget_cap_one_per_key"),
        ]

    def __str__(self) -> str:
        whose = f"{self.customer} key {self.api_key.prefix}" if self.api_key_id else self.customer
        return f"{whose} capped since {self.since:%Y-%m-%d %H:%M}"
