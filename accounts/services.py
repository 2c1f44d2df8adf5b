"""Writes for customers, memberships and API keys."""

from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from accounts import keys
from accounts import scopes as S
from accounts.models import ApiKey, Customer, Membership
from accounts.principals import PLANNERS_GROUP
from controlplane.errors import ConflictError, DomainError


@transaction.atomic
def customer_create(*, name: str, slug: str, tier: str = Customer.Tier.STANDARD) -> Customer:
    if Customer.objects.filter(slug=slug).exists():
        raise ConflictError(f"A customer with slug '{slug}' already exists.", field="slug")
    return Customer.objects.create(name=name, slug=slug, tier=tier)


@transaction.atomic
def membership_set(*, user, customer: Customer, role: str) -> Membership:
    membership, _ = Membership.objects.update_or_create(
        user=user, customer=customer, defaults={"role": role}
    )
    return membership


@dataclass(frozen=True)
class CreatedKey:
    api_key: ApiKey
    plaintext: str  # shown once; never stored


def _validate_scopes(scopes: list[str], *, for_service: bool) -> list[str]:
    allowed = S.SERVICE_SCOPES if for_service else S.CUSTOMER_SCOPES
    unknown = [scope for scope in scopes if scope not in allowed]
    if unknown:
        owner = "a service key" if for_service else "a customer key"
        raise DomainError(
            f"Unknown or not allowed for {owner}: {', '.join(unknown)}. "
            f"Allowed: {', '.join(allowed)}.",
            field="scopes",
        )
    # Keep the caller's order but drop repeats.
    return list(dict.fromkeys(scopes))


@transaction.atomic
def api_key_create(
    *,
    name: str,
    customer: Customer | None = None,
    service_name: str = "",
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    created_by=None,
) -> CreatedKey:
    if (customer is None) == (not service_name):
        raise DomainError(
            "A key belongs to exactly one owner: give a customer or a service name.",
            field="customer",
        )
    for_service = customer is None
    if scopes is None:
        scopes = S.DEFAULT_SERVICE_SCOPES if for_service else S.DEFAULT_CUSTOMER_SCOPES
    scopes = _validate_scopes(scopes, for_service=for_service)
    if not scopes:
        raise DomainError("A key needs at least one scope.", field="scopes")
    if expires_at is not None and expires_at <= timezone.now():
        raise DomainError("The expiry must be in the future.", field="expires_at")
    minted = keys.mint()
    api_key = ApiKey.objects.create(
        name=name,
        customer=customer,
        service_name=service_name,
        prefix=minted.prefix,
        secret_sha256=minted.secret_sha256,
        scopes=scopes,
        expires_at=expires_at,
        created_by=created_by if getattr(created_by, "pk", None) else None,
    )
    return CreatedKey(api_key=api_key, plaintext=minted.plaintext)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoking twice is harmless and keeps the first revocation time."""
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    api_key.refresh_from_db(fields=["revoked_at"])
    return api_key


@transaction.atomic
def planner_create(*, username: str, password: str, email: str = ""):
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username, defaults={"email": email})
    user.is_staff = True
    user.is_active = True
    if email:
        user.email = email
    user.set_password(password)
    user.save()
    group, _ = Group.objects.get_or_create(name=PLANNERS_GROUP)
    user.groups.add(group)
    return user, created
