"""Writes for customers, memberships and API keys."""

import math
import re
from dataclasses import dataclass
from datetime import datetime

from django.apps import apps as live_apps
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts import keys
from accounts import scopes as S
from accounts.hooks import keys_changed
from accounts.models import DEFAULT_TIER, ApiKey, Customer, Membership, Tier
from accounts.principals import PLANNERS_GROUP
from accounts.selectors import live_api_keys_made_by
from core.audit import actor_of as audit_actor_of
from core.audit import audit_change, audit_record, snapshot
from core.errors import ConflictError, DomainError

_CUSTOMER_AUDIT_FIELDS = ("name", "slug", "tier", "may_report_own_usage")
_KEY_AUDIT_FIELDS = ("name", "customer", "service_name", "prefix", "scopes", "expires_at")


@transaction.atomic
def customer_create(
    *,
    name: str,
    slug: str,
    tier: Tier | str = DEFAULT_TIER,
    may_report_own_usage: bool = False,
) -> Customer:
    """A new customer in a tier (by row or name), audited. A slug taken is a 409 on `slug`,
    since the slug is what keys, the portal's URLs and the gateways name the customer by."""
    if Customer.objects.filter(slug=slug).exists():
        raise ConflictError(f"A customer with slug '{slug}' already exists.", field="slug")
    if isinstance(tier, str):
        found = Tier.objects.filter(name=tier).first()
        if found is None:
            raise DomainError(f"There is no tier named '{tier}'.", field="tier", code="invalid")
        tier = found
    customer = Customer.objects.create(
        name=name, slug=slug, tier=tier, may_report_own_usage=may_report_own_usage
    )
    audit_record(
        action="customer.create", obj=customer, after=snapshot(customer, _CUSTOMER_AUDIT_FIELDS)
    )
    return customer


@transaction.atomic
def customer_update(*, customer: Customer, **changes) -> Customer:
    """Change a customer's fields (`changes`: field=value), audited before -> after. Gateways'
    copy of the keys is republished after commit, as it names the customer's slug and tier."""
    customer = Customer.objects.select_for_update().get(pk=customer.pk)
    new_slug = changes.get("slug", customer.slug)
    if Customer.objects.filter(slug=new_slug).exclude(pk=customer.pk).exists():
        raise ConflictError(f"A customer with slug '{new_slug}' already exists.", field="slug")
    before = snapshot(customer, _CUSTOMER_AUDIT_FIELDS)
    for name, value in changes.items():
        setattr(customer, name, value)
    customer.save()
    audit_change(
        action="customer.update",
        obj=customer,
        before=before,
        after=snapshot(customer, _CUSTOMER_AUDIT_FIELDS),
    )
    keys_changed()  # gateways' copy of the keys names the customer's slug
    return customer


@transaction.atomic
def customer_delete(*, customer: Customer) -> None:
    """Delete a customer with nothing billed or metered (those rows protect it)."""
    before = snapshot(customer, _CUSTOMER_AUDIT_FIELDS)
    pk, label = customer.pk, str(customer)
    customer.delete()
    audit_record(
        action="customer.delete",
        object_type="accounts.customer",
        object_id=pk,
        object_repr=label,
        before=before,
    )
    keys_changed()  # its keys went with it


@transaction.atomic
def membership_set(*, user, customer: Customer, role: str) -> Membership:
    """Give a user a role in a customer, making the membership or changing its role; audited
    with the role before (none for a new member) and after."""
    previous = Membership.objects.filter(user=user, customer=customer).first()
    membership, _ = Membership.objects.update_or_create(
        user=user, customer=customer, defaults={"role": role}
    )
    audit_record(
        action="membership.set",
        obj=membership,
        before={"role": previous.role} if previous else None,
        after={"role": role},
    )
    return membership


@transaction.atomic
def customer_user_set(*, username: str, password: str, customer: Customer, role: str):
    """A person of the customer's (the portal's users): the user made or its password reset,
    and its role in the customer set (audited as membership.set). A new user is not staff."""
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username)
    user.is_active = True
    user.set_password(password)
    user.save()
    membership_set(user=user, customer=customer, role=role)
    return user, created


@dataclass(frozen=True)
class CreatedKey:
    """A key just made, with the only copy of its secret the caller will ever get."""

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


def _check_key_may_mint(
    creator: ApiKey, scopes: list[str], expires_at: datetime | None
) -> datetime | None:
    """A key creating a key: never more scopes than its own, never a longer life.

    Returns the expiry to store: a creator that expires passes its own expiry on when none is
    asked for, so a minted key can never outlive the key that minted it.
    """
    missing = [scope for scope in scopes if scope not in creator.scopes]
    if missing:
        raise DomainError(
            "A key may create only keys with a subset of its own scopes; this key lacks "
            f"{', '.join(missing)} (it holds {', '.join(creator.scopes)}).",
            field="scopes",
            code="scope_escalation",
        )
    if creator.expires_at is not None:
        if expires_at is None:
            return creator.expires_at
        if expires_at > creator.expires_at:
            raise DomainError(
                "A key may not create a key that expires after itself "
                f"({creator.expires_at:%Y-%m-%dT%H:%M:%SZ}).",
                field="expires_at",
                code="expiry_beyond_creator",
            )
    return expires_at


@transaction.atomic
def api_key_create(
    *,
    name: str,
    customer: Customer | None = None,
    service_name: str = "",
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
    created_by=None,
    created_by_key: ApiKey | None = None,
    actor: str = "",
) -> CreatedKey:
    """Mint a key for exactly one owner (a customer, or a platform service by name), audited.

    Scopes are checked against what that kind of owner may hold, and a key minting a key gets
    no more scopes and no longer life than its own (`created_by_key`), so a key cannot escalate
    itself. Only the secret's hash is stored; the plaintext is returned once. Gateways' copy of
    the keys is republished after commit, so the key works there within seconds."""
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
    if customer is not None and S.USAGE_WRITE in scopes and not customer.may_report_own_usage:
        raise DomainError(
            f"Customer '{customer.slug}' may not report its own usage, so its keys cannot hold "
            "usage:write; a planner allows it with the customer's may_report_own_usage.",
            field="scopes",
            code="usage_self_report_not_allowed",
        )
    if created_by_key is not None:
        expires_at = _check_key_may_mint(created_by_key, scopes, expires_at)
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
        created_by_key=created_by_key,
    )
    audit_record(
        actor=actor or audit_actor_of(user=created_by, api_key=created_by_key),
        action="api_key.create",
        obj=api_key,
        after=snapshot(api_key, _KEY_AUDIT_FIELDS),
    )
    keys_changed()
    return CreatedKey(api_key=api_key, plaintext=minted.plaintext)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, actor: str = "system:unknown", reason: str = "") -> ApiKey:
    """Revoking twice is harmless and keeps the first revocation time."""
    revoked = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    api_key.refresh_from_db(fields=["revoked_at"])
    if revoked:
        audit_record(
            actor=actor,
            action="api_key.revoke",
            obj=api_key,
            before={"revoked_at": None},
            after=snapshot(api_key, ["revoked_at"]),
            reason=reason,
        )
        keys_changed()
    return api_key


@dataclass(frozen=True)
class RemovedMembership:
    """What removing a person from a customer did: who, in which role, and their keys."""

    username: str
    role: str
    revoked: list[ApiKey]  # the keys the person made, revoked with the membership
    kept: list[ApiKey]  # the keys the person made, left working (revoke_keys=False)


@transaction.atomic
def membership_remove(
    *, membership: Membership, revoke_keys: bool, actor: str
) -> RemovedMembership:
    """Remove a person from a customer. The customer's keys the person made (and the keys those
    keys made: accounts.selectors.live_api_keys_made_by) would otherwise outlive their place
    in it, so the caller says whether they go too: with revoke_keys each is revoked (audited
    as api_key.revoke, with the reason). Audited as membership.remove on the customer, whose
    history then shows who left and which of their keys were revoked or kept."""
    membership = Membership.objects.select_related("user", "customer").get(pk=membership.pk)
    customer, user = membership.customer, membership.user
    username = user.get_username()
    made = live_api_keys_made_by(customer, [user.pk])[user.pk]
    revoked: list[ApiKey] = []
    if revoke_keys:
        reason = f"made by {username}, removed from {customer.slug}"
        for api_key in made:
            revoked.append(api_key_revoke(api_key=api_key, actor=actor, reason=reason))
    kept = [] if revoke_keys else made
    membership.delete()
    audit_record(
        actor=actor,
        action="membership.remove",
        obj=customer,
        before={"member": username, "role": membership.role},
        after={
            "member": None,
            "keys_revoked": [api_key.prefix for api_key in revoked],
            "keys_kept": [api_key.prefix for api_key in kept],
        },
    )
    return RemovedMembership(username=username, role=membership.role, revoked=revoked, kept=kept)


@transaction.atomic
def planner_create(*, username: str, password: str, email: str = ""):
    """A planner (staff, in the planners group), made or its password reset; returns (user,
    created). `manage.py create_planner` provisions planners with it."""
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username, defaults={"email": email})
    user.is_staff = True
    user.is_active = True
    if email:
        user.email = email
    user.set_password(password)
    user.save()
    # The group with its model permissions: a planner defines tiers in the admin too.
    user.groups.add(planners_group_ensure())
    return user, created


# --- Tiers: planner-defined (name, weight, shed order) -----------------------------------------

TIER_FIELDS = ("label", "weight", "shed_order")
_TIER_AUDIT_FIELDS = ("name", "label", "weight", "shed_order")
MAX_SHED_ORDER = 32767  # the column is a PostgreSQL smallint
MAX_TIER_WEIGHT = 1_000_000.0
TIER_NAME = re.compile(r"[-a-zA-Z0-9_]+")


def _check_tier(values: dict) -> None:
    weight = values.get("weight")
    if weight is not None and (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or not 0 <= weight <= MAX_TIER_WEIGHT
    ):
        raise DomainError(
            f"weight is a number from 0 to {MAX_TIER_WEIGHT:g} (its share of the even part of "
            "best-effort slack, relative to the other tiers').",
            field="weight",
        )
    shed_order = values.get("shed_order")
    if shed_order is not None and (
        isinstance(shed_order, bool)
        or not isinstance(shed_order, int)
        or not 1 <= shed_order <= MAX_SHED_ORDER
    ):
        raise DomainError(
            f"shed_order is a whole number from 1 to {MAX_SHED_ORDER} (the lowest is shed first).",
            field="shed_order",
        )
    label = values.get("label")
    if label is not None and len(label) > 100:
        raise DomainError("label is at most 100 characters.", field="label")


def _shed_order_free(shed_order: int, *, tier: Tier | None = None) -> None:
    taken = Tier.objects.filter(shed_order=shed_order).exclude(pk=tier.pk if tier else None)
    holder = taken.first()
    if holder is not None:
        raise ConflictError(
            f"The tier {holder.name} is shed at {shed_order} already: each tier has its own "
            "place in the shed order.",
            field="shed_order",
        )


def _save_tier(tier: Tier) -> None:
    """Save; a name or shed order taken meanwhile (the unique constraints decide) is a 409."""
    try:
        with transaction.atomic():
            tier.save()
    except IntegrityError:
        raise ConflictError(
            f"The name {tier.name} or the shed order {tier.shed_order} was taken meanwhile.",
            field="shed_order",
        ) from None


@transaction.atomic
def tier_create(
    *, name: str, shed_order: int, label: str = "", weight: float = 1.0, actor: str | None = None
) -> Tier:
    """A new tier. Its name is what customers refer to it by, so it is fixed once made."""
    if not name or len(name) > 20 or not TIER_NAME.fullmatch(name):
        raise DomainError("name is 1 to 20 letters, digits, hyphens or underscores.", field="name")
    _check_tier({"label": label, "weight": weight, "shed_order": shed_order})
    if Tier.objects.filter(name=name).exists():
        raise ConflictError(f"A tier named '{name}' exists already.", field="name")
    _shed_order_free(shed_order)
    tier = Tier(name=name, label=label, weight=float(weight), shed_order=shed_order)
    _save_tier(tier)
    audit_record(
        actor=actor, action="tier.create", obj=tier, after=snapshot(tier, _TIER_AUDIT_FIELDS)
    )
    keys_changed()  # gateways' copy names the customers' tiers
    return tier


@transaction.atomic
def tier_update(*, tier: Tier, changes: dict, actor: str | None = None) -> Tier:
    """Change a tier's label, weight or shed order (`changes`: field -> value). A weight
    reaches the next allocation tick, a shed order the next degradation step."""
    unknown = sorted(set(changes) - set(TIER_FIELDS))
    if unknown:
        raise DomainError(
            f"{unknown[0]} cannot be changed (a tier's name is fixed: customers refer to it).",
            field=unknown[0],
        )
    _check_tier(changes)
    tier = Tier.objects.select_for_update().get(pk=tier.pk)
    if "shed_order" in changes:
        _shed_order_free(changes["shed_order"], tier=tier)
    before = snapshot(tier, _TIER_AUDIT_FIELDS)
    for name, value in changes.items():
        setattr(tier, name, float(value) if name == "weight" else value)
    _save_tier(tier)
    if audit_change(
        actor=actor,
        action="tier.update",
        obj=tier,
        before=before,
        after=snapshot(tier, _TIER_AUDIT_FIELDS),
    ):
        keys_changed()
    return tier


@transaction.atomic
def tier_delete(*, tier: Tier, actor: str | None = None) -> None:
    """Delete a tier no customer is in; the default tier (new customers') stays."""
    tier = Tier.objects.select_for_update().get(pk=tier.pk)
    if tier.name == DEFAULT_TIER:
        raise ConflictError(
            f"The tier {DEFAULT_TIER} is where new customers go: it cannot be deleted.",
            field="name",
        )
    in_it = Customer.objects.filter(tier=tier).count()
    if in_it:
        raise ConflictError(
            f"{in_it} customer(s) are in the tier {tier.name}: move them to another first.",
            field="name",
            details={"customers": in_it},
        )
    before = snapshot(tier, _TIER_AUDIT_FIELDS)
    pk, label = tier.pk, str(tier)
    tier.delete()
    audit_record(
        actor=actor,
        action="tier.delete",
        object_type=Tier._meta.label_lower,
        object_id=pk,
        object_repr=label,
        before=before,
    )
    keys_changed()


# What planners may do in the admin beyond the planner UI: define tiers.
PLANNER_MODEL_PERMISSIONS = (
    ("accounts", "add_tier"),
    ("accounts", "change_tier"),
    ("accounts", "delete_tier"),
    ("accounts", "view_tier"),
)


def planners_group_ensure(*, apps=None, using: str = "default"):
    """The planners group, holding the model permissions planners use in the admin (tiers).
    `apps`: a migration state's (post_migrate), else the live models."""
    apps = apps or live_apps
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    group, _ = group_model._default_manager.using(using).get_or_create(name=PLANNERS_GROUP)
    wanted = permission_model._default_manager.using(using).filter(
        content_type__app_label__in={app for app, _ in PLANNER_MODEL_PERMISSIONS},
        codename__in={codename for _, codename in PLANNER_MODEL_PERMISSIONS},
    )
    group.permissions.add(*wanted)
    return group


def ensure_planners_group(sender=None, *, apps=None, using="default", **kwargs) -> None:
    """post_migrate: make the planners group and grant it its permissions, once auth's tables
    exist (`planners_group_ensure`)."""
    apps = apps or live_apps
    try:
        apps.get_model("auth", "Group")
        apps.get_model("auth", "Permission")
    except LookupError:  # auth not migrated yet
        return
    planners_group_ensure(apps=apps, using=using)
