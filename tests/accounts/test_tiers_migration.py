"""Migration accounts 0004 (issue 23, tiers) on stored customers: the fixed tier choices become
planner-defined tiers, every customer keeps the tier it had (a value outside the old choices
too), and the new `free` tier is the first that degradation sheds."""

import pytest

from tests.support.migrations import migrate_to, migrate_to_the_leaf

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_databases]

BEFORE = ("accounts", "0003_customer_keys_lose_usage_write")
TIERS = ("accounts", "0004_tiers")


def test_customers_keep_their_tier_and_free_is_added_and_shed_first(back_to_the_leaf):
    old = migrate_to([BEFORE])
    Customer = old.get_model("accounts", "Customer")
    stored = {
        "plain": "standard",
        "better": "premium",
        "biggest": "enterprise",
        # Written past the choices (raw SQL, an old import): kept, shed after the known tiers.
        "odd": "gold",
    }
    for slug, tier in stored.items():
        Customer.objects.create(name=slug.title(), slug=slug, tier=tier)

    new = migrate_to([TIERS])

    Tier = new.get_model("accounts", "Tier")
    assert list(Tier.objects.order_by("shed_order").values_list("name", "weight")) == [
        ("free", 1.0),
        ("standard", 2.0),
        ("premium", 4.0),
        ("enterprise", 8.0),
        ("gold", 1.0),
    ]
    migrated = new.get_model("accounts", "Customer").objects
    assert {c.slug: c.tier_id for c in migrated.all()} == stored
    assert migrated.get(slug="better").tier.shed_order == 3
    assert not migrated.filter(tier_id="free").exists()  # a new tier: nobody moved into it

    # With today's code on the migrated rows: degradation's level 1 sheds free first, and the
    # customers' tiers are what they were.
    migrate_to_the_leaf()
    from accounts.models import Customer as LiveCustomer
    from capacity.health.degradation import tiers_in_shed_order

    assert tiers_in_shed_order() == ["free", "standard", "premium", "enterprise", "gold"]
    assert LiveCustomer.objects.get(slug="biggest").tier.name == "enterprise"
