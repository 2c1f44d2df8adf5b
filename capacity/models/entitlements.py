"""Entitlements: which served models a customer's keys may use (issue 18).

An allow-list, customer × model: a customer without a row for a model may not use it through a
gateway (capacity.publication publishes the list as `gw:v1:entitlements`). Service keys are not
limited by it. Written only by capacity.selling.entitlements, which audits every change.
"""

from django.db import models

from accounts.models import Customer
from capacity.models.catalog import ServedModel


class Entitlement(models.Model):
    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="entitlements")
    # PROTECT: a model customers are entitled to is withdrawn first, on purpose, not by a delete.
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="entitlements"
    )
    granted_at = models.DateTimeField(auto_now_add=True)
    granted_by = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["customer_id", "served_model__name"]
        constraints = [
            # serves: the customer's list (GET /customers/{slug}/entitlements) and the one-row rule
            models.UniqueConstraint(
                fields=["customer", "served_model"], name="entitlement_once_per_customer_model"
            )
        ]

    def __str__(self) -> str:
        return f"{self.customer_id} may use {self.served_model_id}"
