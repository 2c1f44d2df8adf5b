"""Tiers are planner-defined for real: a planner made by `create_planner` (staff, in the
planners group, not a superuser) defines them through /api/v1/tiers/, on the planner's tiers
page and in the admin, every change audited; everyone signed in reads them."""

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.core.management.sql import emit_post_migrate_signal
from django.urls import reverse

from accounts.models import Customer, Tier
from accounts.principals import PLANNERS_GROUP
from accounts.services import customer_create
from capacity.health.degradation import tiers_in_shed_order
from core.models import AuditEntry

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

PASSWORD = "tiers-are-planned-42"


@pytest.fixture
def pat(monkeypatch, django_user_model):
    # A fresh install: no planners group until create_planner makes it.
    Group.objects.filter(name=PLANNERS_GROUP).delete()
    monkeypatch.setenv("PLANNER_PASSWORD", PASSWORD)
    call_command("create_planner", "pat", "--email", "pat@example.com")
    user = django_user_model.objects.get(username="pat")
    assert (user.is_staff, user.is_superuser) == (True, False)
    return user


@pytest.fixture
def pat_client(client, pat):
    signed_in = client.post("/login/", {"username": "pat", "password": PASSWORD})
    assert signed_in.status_code == 302
    return client


def test_a_planner_defines_tiers_through_the_api_and_everyone_signed_in_reads_them(
    pat_client, owner_client, anon, acme
):
    made = pat_client.post(
        "/api/v1/tiers/",
        {"name": "startup", "label": "Startup", "weight": 1.5, "shed_order": 5},
        content_type="application/json",
    )
    assert made.status_code == 201, made.json()
    assert made.json() == {"name": "startup", "label": "Startup", "weight": 1.5, "shed_order": 5}
    entry = AuditEntry.objects.get(action="tier.create")
    assert entry.actor == "user:pat" and entry.after["weight"] == 1.5

    # The degradation ladder now ends with it; move it to the front: it is shed first.
    assert tiers_in_shed_order()[-1] == "startup"
    moved = pat_client.patch(
        "/api/v1/tiers/startup/", {"shed_order": 0}, content_type="application/json"
    )
    assert moved.status_code == 400  # places start at 1
    Tier.objects.filter(name="free").update(shed_order=6)
    moved = pat_client.patch(
        "/api/v1/tiers/startup/", {"shed_order": 1, "weight": 3}, content_type="application/json"
    )
    assert moved.status_code == 200, moved.json()
    assert tiers_in_shed_order()[0] == "startup"
    change = AuditEntry.objects.get(action="tier.update")
    assert (change.before, change.after) == (
        {"shed_order": 5, "weight": 1.5},
        {"shed_order": 1, "weight": 3.0},
    )

    renamed = pat_client.patch(
        "/api/v1/tiers/startup/", {"name": "scaleup"}, content_type="application/json"
    )
    assert renamed.status_code == 400 and "name" in str(renamed.json())
    clash = pat_client.post(
        "/api/v1/tiers/",
        {"name": "gold", "weight": 2, "shed_order": 1},
        content_type="application/json",
    )
    assert clash.status_code == 409 and "startup" in clash.json()["error"]["message"]

    # Everyone signed in reads them, in shed order; only planners write.
    listed = owner_client.get("/api/v1/tiers/")
    assert listed.status_code == 200
    assert [t["name"] for t in listed.json()["results"]] == [
        "startup", "standard", "premium", "enterprise", "free",
    ]  # fmt: skip
    assert owner_client.get("/api/v1/tiers/premium/").json()["weight"] == 4.0
    assert (
        owner_client.post(
            "/api/v1/tiers/", {"name": "mine", "shed_order": 9}, format="json"
        ).status_code
        == 403
    )
    assert (
        owner_client.patch("/api/v1/tiers/free/", {"weight": 99}, format="json").status_code == 403
    )
    assert anon.get("/api/v1/tiers/").status_code == 401

    # A tier with customers, and the default tier, stay.
    customer_create(name="Seed", slug="seed", tier="startup")
    in_use = pat_client.delete("/api/v1/tiers/startup/")
    assert in_use.status_code == 409 and "1 customer(s)" in in_use.json()["error"]["message"]
    assert pat_client.delete("/api/v1/tiers/standard/").status_code == 409
    Customer.objects.filter(slug="seed").update(tier="premium")
    assert pat_client.delete("/api/v1/tiers/startup/").status_code == 204
    assert not Tier.objects.filter(name="startup").exists()
    assert AuditEntry.objects.get(action="tier.delete").before["name"] == "startup"


def test_a_planner_defines_tiers_on_the_planner_page(pat_client, acme, globex):
    page = pat_client.get("/planner/tiers/")
    assert page.status_code == 200
    html = page.content.decode()
    # acme and globex are in the default tier: 2 customers, no delete button for it.
    standard = html.split('data-testid="tier-standard"')[1].split("</tr>")[0]
    assert '<td class="num">2</td>' in standard and "Delete" not in standard
    assert 'href="/planner/tiers/"' in html  # in the planner's navigation

    made = pat_client.post(
        "/planner/tiers/", {"name": "startup", "label": "Startup", "weight": "1.5",
                            "shed_order": "5"},
    )  # fmt: skip
    assert made.status_code == 302
    assert Tier.objects.get(name="startup").weight == 1.5
    assert AuditEntry.objects.get(action="tier.create").actor == "user:pat"

    changed = pat_client.post(
        "/planner/tiers/startup/",
        {"startup-label": "Start-ups", "startup-weight": "2.5", "startup-shed_order": "6"},
    )
    assert changed.status_code == 302
    tier = Tier.objects.get(name="startup")
    assert (tier.label, tier.weight, tier.shed_order) == ("Start-ups", 2.5, 6)

    clash = pat_client.post(
        "/planner/tiers/startup/",
        {"startup-label": "", "startup-weight": "1", "startup-shed_order": "1"},
    )
    assert clash.status_code == 409
    assert "The tier free is shed at 1 already" in clash.content.decode()
    assert Tier.objects.get(name="startup").shed_order == 6

    deleted = pat_client.post("/planner/tiers/startup/delete")
    assert deleted.status_code == 302
    assert not Tier.objects.filter(name="startup").exists()
    refused = pat_client.post("/planner/tiers/standard/delete", follow=True)
    assert "was not deleted" in refused.content.decode()
    assert Tier.objects.filter(name="standard").exists()


def test_a_planner_defines_tiers_in_the_admin(pat_client):
    index = pat_client.get("/admin/")
    assert index.status_code == 200
    assert reverse("admin:accounts_tier_changelist") in index.content.decode()

    made = pat_client.post(
        reverse("admin:accounts_tier_add"),
        {"name": "startup", "label": "Startup", "weight": "1.5", "shed_order": "5"},
    )
    assert made.status_code == 302
    tier = Tier.objects.get(name="startup")
    assert AuditEntry.objects.get(action="tier.create").actor == "user:pat"
    changed = pat_client.post(
        reverse("admin:accounts_tier_change", args=[tier.pk]),
        {"label": "Startup", "weight": "3", "shed_order": "5"},
    )
    assert changed.status_code == 302
    assert Tier.objects.get(name="startup").weight == 3.0

    standard = Tier.objects.get(name="standard")
    assert (
        pat_client.get(reverse("admin:accounts_tier_delete", args=[standard.pk])).status_code == 403
    )
    gone = pat_client.post(reverse("admin:accounts_tier_delete", args=[tier.pk]), {"post": "yes"})
    assert gone.status_code == 302 and not Tier.objects.filter(name="startup").exists()
    # Customers are still the superuser's to edit in the admin (the planner UI has its own).
    assert pat_client.get(reverse("admin:accounts_customer_changelist")).status_code == 403


def test_an_existing_planners_group_gets_the_tier_permissions_at_the_next_migrate():
    group, _ = Group.objects.get_or_create(name=PLANNERS_GROUP)
    group.permissions.clear()  # as an install made before planners defined tiers

    emit_post_migrate_signal(verbosity=0, interactive=False, db="default")  # what migrate ends with

    assert sorted(group.permissions.values_list("codename", flat=True)) == [
        "add_tier",
        "change_tier",
        "delete_tier",
        "view_tier",
    ]
