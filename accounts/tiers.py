"""The tiers a fresh database starts with (accounts.Tier; planners change them in the admin).

Migration 0004 turned the fixed choices into these rows once; `ensure_default_tiers` puts them
back after every `migrate` or `flush` that leaves the table empty (a test database flushed
between transactional tests, a new install), since every customer needs a tier and the
default one (`standard`) must exist.
"""

from __future__ import annotations

from django.apps import apps as live_apps

# name, label, weight, shed order: the cheapest tier is shed first, and each paid tier weighs
# twice the one below it in the even part of the best-effort split.
DEFAULT_TIERS = [
    ("free", "Free", 1.0, 1),
    ("standard", "Standard", 2.0, 2),
    ("premium", "Premium", 4.0, 3),
    ("enterprise", "Enterprise", 8.0, 4),
]


def ensure_default_tiers(sender=None, *, apps=None, using="default", **kwargs) -> None:
    """A post_migrate receiver: the default tiers, when there is no tier at all."""
    apps = apps or live_apps
    try:
        tier_model = apps.get_model("accounts", "Tier")
    except LookupError:  # migrated back past the tiers' migration
        return
    manager = tier_model._default_manager.using(using)
    if manager.exists():
        return
    manager.bulk_create(
        [
            tier_model(name=name, label=label, weight=weight, shed_order=shed_order)
            for name, label, weight, shed_order in DEFAULT_TIERS
        ]
    )
