"""Keys a member made outlive the member (issue 34, finding 6): removing a person from a
customer offers to revoke the keys they made, and the keys those keys made, wherever people are
removed (the service here and the admin; the planner's and the portal's pages in their own
tests). Audited: who left, and which of their keys were revoked or kept."""

import pytest

from accounts.models import ApiKey, Membership
from accounts.services import api_key_create, membership_remove
from core.models import AuditEntry

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


@pytest.fixture
def made(acme, globex, owner, member):
    """The member's keys of acme (one they made, one that key made, one revoked already), the
    owner's key, and a key the member made for another customer (as its owner)."""
    ci = api_key_create(name="ci", customer=acme, scopes=["read", "write"], created_by=member)
    child = api_key_create(
        name="from ci", customer=acme, scopes=["read"], created_by_key=ci.api_key
    )
    old = api_key_create(name="old", customer=acme, created_by=member)
    ApiKey.objects.filter(pk=old.api_key.pk).update(revoked_at="2026-01-01T00:00:00Z")
    Membership.objects.create(user=member, customer=globex, role=Membership.Role.OWNER)
    elsewhere = api_key_create(name="globex's", customer=globex, created_by=member)
    owners = api_key_create(name="owner's", customer=acme, created_by=owner)
    return {"ci": ci, "child": child, "elsewhere": elsewhere, "owners": owners}


def test_removing_a_person_revokes_the_keys_they_made_and_the_keys_those_made(
    acme, member, made, key_client
):
    membership = Membership.objects.get(user=member, customer=acme)
    removed = membership_remove(membership=membership, revoke_keys=True, actor="user:boss")

    assert [key.name for key in removed.revoked] == ["ci", "from ci"]
    assert removed.kept == []
    assert not Membership.objects.filter(user=member, customer=acme).exists()
    for name in ("ci", "child"):
        assert key_client(made[name].plaintext).get("/api/v1/me").status_code == 401, name
    # Not theirs, or not this customer's: untouched.
    for name in ("owners", "elsewhere"):
        assert key_client(made[name].plaintext).get("/api/v1/me").status_code == 200, name

    entry = AuditEntry.objects.get(action="membership.remove")
    assert (entry.actor, entry.object_type, entry.object_id) == ("user:boss", "accounts.customer",
                                                                 str(acme.pk))  # fmt: skip
    assert entry.before == {"member": "member", "role": "member"}
    prefixes = [made["ci"].api_key.prefix, made["child"].api_key.prefix]
    assert entry.after == {"member": None, "keys_revoked": prefixes, "keys_kept": []}
    revocations = AuditEntry.objects.filter(action="api_key.revoke").order_by("id")
    assert [(e.object_id, e.actor) for e in revocations] == [
        (str(made["ci"].api_key.pk), "user:boss"),
        (str(made["child"].api_key.pk), "user:boss"),
    ]
    assert revocations[0].reason == "made by member, removed from acme"


def test_removing_a_person_may_keep_the_keys_they_made(acme, member, made, key_client):
    membership = Membership.objects.get(user=member, customer=acme)
    removed = membership_remove(membership=membership, revoke_keys=False, actor="user:boss")

    assert [key.name for key in removed.kept] == ["ci", "from ci"]
    assert removed.revoked == []
    for name in ("ci", "child"):
        assert key_client(made[name].plaintext).get("/api/v1/me").status_code == 200, name
    entry = AuditEntry.objects.get(action="membership.remove")
    assert entry.after["keys_kept"] == [made["ci"].api_key.prefix, made["child"].api_key.prefix]
    assert not AuditEntry.objects.filter(action="api_key.revoke").exists()


@pytest.fixture
def admin_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "r@example.com", "pw"))
    return client


def test_the_admins_delete_lists_the_keys_it_revokes_and_revokes_them(
    acme, member, made, admin_client, key_client
):
    membership = Membership.objects.get(user=member, customer=acme)
    url = f"/admin/accounts/membership/{membership.pk}/delete/"
    confirmation = admin_client.get(url).content.decode()
    assert f"API key {made['ci'].api_key.prefix} (ci): revoked" in confirmation
    assert f"API key {made['child'].api_key.prefix} (from ci): revoked" in confirmation
    assert made["owners"].api_key.prefix not in confirmation

    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not Membership.objects.filter(pk=membership.pk).exists()
    assert key_client(made["ci"].plaintext).get("/api/v1/me").status_code == 401
    assert AuditEntry.objects.get(action="membership.remove").actor == "user:root"


def test_the_admins_action_removes_people_and_keeps_their_keys(
    acme, member, made, admin_client, key_client
):
    membership = Membership.objects.get(user=member, customer=acme)
    response = admin_client.post(
        "/admin/accounts/membership/",
        {"action": "remove_keeping_keys", "_selected_action": [membership.pk]},
        follow=True,
    )
    assert "Removed 1 person(s); 2 key(s) kept." in response.content.decode()
    assert not Membership.objects.filter(pk=membership.pk).exists()
    assert key_client(made["ci"].plaintext).get("/api/v1/me").status_code == 200


def test_the_customers_admin_page_no_longer_deletes_people_around_the_service(
    acme, member, admin_client
):
    """Its inline would delete a membership without a word about the keys: it adds and edits
    people; the Memberships page removes them."""
    page = admin_client.get(f"/admin/accounts/customer/{acme.pk}/change/").content.decode()
    assert "memberships-0-DELETE" not in page
    assert "memberships-0-role" in page
