"""Planner-defined tiers: the migrated rows, customers' tiers through the API, the admin."""

import pytest
from django.urls import reverse

from accounts.models import Customer, Tier
from core.models import AuditEntry

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def test_the_old_choices_are_tiers_with_free_shed_first():
    assert list(Tier.objects.values_list("name", "shed_order")) == [
        ("free", 1),
        ("standard", 2),
        ("premium", 3),
        ("enterprise", 4),
    ]


def test_a_customer_gets_a_tier_by_name_and_an_unknown_one_is_refused(planner_client):
    made = planner_client.post(
        "/api/v1/customers/", {"name": "Hooli", "slug": "hooli", "tier": "free"}, format="json"
    )
    assert made.status_code == 201 and made.json()["tier"] == "free"
    assert Customer.objects.get(slug="hooli").tier.weight == 1.0

    bad = planner_client.patch("/api/v1/customers/hooli/", {"tier": "gold"}, format="json")
    assert bad.status_code == 400
    assert "tier" in str(bad.json())
    assert Customer.objects.get(slug="hooli").tier_id == "free"


def test_planners_define_tiers_in_the_admin_with_an_audit_record(client, django_user_model):
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    made = client.post(
        reverse("admin:accounts_tier_add"),
        {"name": "startup", "label": "Startup", "weight": "1.5", "shed_order": "5"},
    )
    assert made.status_code == 302
    tier = Tier.objects.get(name="startup")
    entry = AuditEntry.objects.get(action="tier.create")
    assert entry.actor == "user:root" and entry.after["weight"] == 1.5

    changed = client.post(
        reverse("admin:accounts_tier_change", args=[tier.pk]),
        {"label": "Startup", "weight": "3", "shed_order": "5"},
    )
    assert changed.status_code == 302
    tier.refresh_from_db()
    assert (tier.name, tier.weight) == ("startup", 3.0)  # the name is fixed once made
    assert AuditEntry.objects.get(action="tier.update").after == {"weight": 3.0}
    # A shed order is a tier's place in the ladder: two tiers cannot share one.
    clash = client.post(
        reverse("admin:accounts_tier_add"),
        {"name": "other", "label": "", "weight": "1", "shed_order": "5"},
    )
    assert clash.status_code == 200 and not Tier.objects.filter(name="other").exists()
