from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q


class Tier(models.Model):
    """A planner-defined class of customer (free, standard, ...): its weight in the even part
    of the best-effort split (capacity.allocation.policy) and its place in the order in which
    degradation sheds best-effort traffic (capacity.health.degradation): the lowest
    `shed_order` first."""

    # Customers refer to a tier by name (Customer.tier's column holds it, as it did when tiers
    # were fixed choices), so the API, filters and audit records keep the readable name.
    name = models.SlugField(max_length=20, unique=True)
    label = models.CharField(max_length=100, blank=True, default="")
    weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.0)],
        help_text="Share of the even part of best-effort slack, relative to other tiers.",
    )
    shed_order = models.PositiveSmallIntegerField(
        unique=True,
        help_text="Degradation refuses best-effort of the lowest shed order first.",
    )

    class Meta:
        ordering = ["shed_order"]

    def __str__(self) -> str:
        return self.name


DEFAULT_TIER = "standard"


class Customer(models.Model):
    """A tenant: buys reservations, sends usage, receives invoices."""

    name = models.CharField(max_length=200)
    # serves: Customer by slug: API /customers/{slug}, planner pages, customers_by_slug
    slug = models.SlugField(max_length=64, unique=True)
    tier = models.ForeignKey(
        Tier,
        to_field="name",
        db_column="tier",
        on_delete=models.PROTECT,
        default=DEFAULT_TIER,
        related_name="customers",
    )
    # Usage is what the customer is billed on, so by default only the platform's own gateways
    # report it; a planner may let a customer run its own gateway (its events are then marked
    # self-reported on the invoice).
    may_report_own_usage = models.BooleanField(
        default=False,
        help_text="Keys of this customer may post its usage events (marked self-reported).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    """A Django user's role within one customer."""

    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"
        VIEWER = "viewer", "Viewer"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    customer = models.ForeignKey(Customer, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["customer__slug", "user__username"]
        constraints = [
            # serves: services' membership by (user, customer); principals' user.memberships
            models.UniqueConstraint(fields=["user", "customer"], name="membership_unique_user"),
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.customer} ({self.role})"


class ApiKey(models.Model):
    """A bearer credential, shown once as `prefix.secret` and kept as prefix + SHA-256(secret).

    A key belongs either to a customer (it sees only that customer) or to a platform service
    such as a gateway or a provisioning system (`service_name`; it acts across customers
    within its scopes). The secret is never stored.
    """

    name = models.CharField(max_length=200)
    customer = models.ForeignKey(
        Customer, on_delete=models.CASCADE, null=True, blank=True, related_name="api_keys"
    )
    service_name = models.CharField(max_length=100, blank=True, default="")
    # serves: accounts.authentication: the key by prefix on every request
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_sha256 = models.CharField(max_length=64, editable=False)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    # A key created by another key (through the API) may hold only a subset of its creator's
    # scopes and expire no later than it.
    created_by_key = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # Exactly one owner: a customer or a named service.
            models.CheckConstraint(
                condition=(
                    (Q(customer__isnull=False) & Q(service_name=""))
                    | (Q(customer__isnull=True) & ~Q(service_name=""))
                ),
                name="apikey_one_owner",
            ),
        ]
        # serves: api_keys_of_customer_newest_first; api_keys_visible_to (customer)
        indexes = [models.Index(fields=["customer", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.prefix} ({self.owner_label})"

    @property
    def owner_label(self) -> str:
        return (
            f"customer:{self.customer.slug}" if self.customer_id else f"service:{self.service_name}"
        )
