from django.db import models
from django.db.models import F, Q

from accounts.models import Customer
from capacity.models.catalog import ServedModel


class ReservationQuerySet(models.QuerySet):
    """The terms of reservations, written once: "sold at a moment" and "overlapping a span"."""

    def not_cancelled(self) -> "ReservationQuerySet":
        return self.exclude(status=Reservation.Status.CANCELLED)

    def in_term_at(self, moment) -> "ReservationQuerySet":
        """Reservations whose term [starts_at, ends_at) covers the moment, whatever status."""
        return self.filter(starts_at__lte=moment).filter(
            Q(ends_at__isnull=True) | Q(ends_at__gt=moment)
        )

    def active_at(self, moment) -> "ReservationQuerySet":
        """What is sold at the moment: in term there and not cancelled."""
        return self.not_cancelled().in_term_at(moment)

    def overlapping(self, start, end) -> "ReservationQuerySet":
        """Reservations whose term meets [start, end); `end` None: open-ended."""
        overlapping = self.filter(Q(ends_at__isnull=True) | Q(ends_at__gt=start))
        return overlapping if end is None else overlapping.filter(starts_at__lt=end)


class Reservation(models.Model):
    """Sold capacity: a customer is guaranteed `mu_per_minute` of a model for a term.

    `status` is kept current by a periodic task; `cancelled` is final. Selling checks the term
    against every overlapping reservation that is not cancelled (docs/design.md#sold).
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Pending (starts later)"
        ACTIVE = "active", "Active"
        EXPIRED = "expired", "Expired"
        CANCELLED = "cancelled", "Cancelled"

    customer = models.ForeignKey(Customer, on_delete=models.PROTECT, related_name="reservations")
    served_model = models.ForeignKey(
        ServedModel, on_delete=models.PROTECT, related_name="reservations"
    )
    mu_per_minute = models.FloatField()
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True, help_text="Empty: open-ended.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    keep_warm = models.BooleanField(
        default=False, help_text="Keep the model's replicas up even when idle."
    )
    notes = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = ReservationQuerySet.as_manager()

    class Meta:
        ordering = ["-starts_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(mu_per_minute__gt=0), name="reservation_mu_positive"
            ),
            models.CheckConstraint(
                condition=Q(ends_at__isnull=True) | Q(ends_at__gt=F("starts_at")),
                name="reservation_ends_after_start",
            ),
        ]
        indexes = [
            # serves: utilisation.sold_now, sellable.sold_moments (a group of models' reservations)
            models.Index(fields=["served_model", "status", "starts_at"]),
            # serves: customer_utilisation, reserved_mu_per_minute_by_customer
            models.Index(fields=["customer", "served_model", "starts_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.customer} {self.mu_per_minute:g} MU/min of {self.served_model}"


class ReservationChange(models.Model):
    """The history of a reservation: what changed, when, and by whom."""

    class Kind(models.TextChoices):
        CREATED = "created", "Created"
        AMENDED = "amended", "Amended"
        CANCELLED = "cancelled", "Cancelled"

    reservation = models.ForeignKey(Reservation, on_delete=models.CASCADE, related_name="changes")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    changes = models.JSONField(default=dict, help_text="field → [old, new]")
    changed_by = models.CharField(max_length=200, blank=True, default="")
    changed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["reservation_id", "changed_at", "id"]

    def __str__(self) -> str:
        return f"{self.reservation_id} {self.kind} at {self.changed_at:%Y-%m-%d %H:%M}"
