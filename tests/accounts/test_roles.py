"""Portal roles are API roles (issue 34, finding 6): the portal refused a member's key forms
(403), but the API let the same session create a `read write admission` key and revoke the
owner's key. A customer's owners manage its keys; members and viewers read, on every surface,
and a key acts for the person who made it, never beyond their role now."""

import pytest

from accounts import scopes as S
from accounts.models import ApiKey, Membership
from accounts.services import api_key_create, membership_set
from tests.support.factories import MembershipFactory

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
KEYS = "/api/v1/api-keys/"


def mint(client, customer="acme", **body):
    return client.post(KEYS, {"name": "minted", "customer": customer} | body, format="json")


def test_every_role_a_person_can_hold_has_its_rule():
    """A role added to memberships without a rule would silently read nothing and manage
    nothing; the rule names each one, and only owners manage."""
    assert set(S.ROLE_SCOPES) == set(Membership.Role.values)
    managers = {role for role in Membership.Role.values if S.role_manages_keys(role)}
    assert managers == {Membership.Role.OWNER}


def test_a_member_creates_no_key_and_revokes_none_through_the_api(
    acme, owner, member_client, key_client
):
    """The finding, step by step: the member's session asks for a `read write admission` key
    and then revokes the owner's key."""
    owners_key = api_key_create(name="owner's", customer=acme, created_by=owner)

    created = mint(member_client, scopes=["read", "write", "admission"])
    assert created.status_code == 403
    assert "owners create its keys" in created.json()["error"]["message"]
    revoked = member_client.post(f"{KEYS}{owners_key.api_key.pk}/revoke/")
    assert revoked.status_code == 403
    assert "its owners manage its keys" in revoked.json()["error"]["message"]

    assert ApiKey.objects.filter(customer=acme).count() == 1
    assert key_client(owners_key.plaintext).get("/api/v1/me").status_code == 200
    # It still reads the keys, as in the portal, and is told it only reads.
    assert member_client.get(KEYS).status_code == 200
    assert member_client.get("/api/v1/me").json()["scopes"] == ["read"]


def test_a_viewer_creates_no_key_and_an_owner_does(acme, owner_client, client):
    viewer = MembershipFactory(customer=acme, role=Membership.Role.VIEWER).user
    client.force_login(viewer)
    assert mint(client, scopes=["read"]).status_code == 403
    created = mint(owner_client, scopes=["read", "write", "admission"])
    assert created.status_code == 201, created.json()


def test_an_owner_of_one_customer_manages_only_that_ones_keys(acme, globex, client, key_client):
    """The role is per customer: an owner of globex who is a member of acme."""
    both = MembershipFactory(customer=globex, role=Membership.Role.OWNER).user
    MembershipFactory(user=both, customer=acme, role=Membership.Role.MEMBER)
    acme_key = api_key_create(name="acme's", customer=acme).api_key
    client.force_login(both)
    assert mint(client, customer="acme", scopes=["read"]).status_code == 403
    assert client.post(f"{KEYS}{acme_key.pk}/revoke/").status_code == 403
    assert mint(client, customer="globex", scopes=["read"]).status_code == 201
    assert ApiKey.objects.get(pk=acme_key.pk).revoked_at is None


def test_a_write_key_manages_keys_only_while_the_person_who_made_it_is_an_owner(
    acme, owner, member, key_client
):
    """A `write` key made by a member (as the API allowed before) or by an owner since made a
    member, and the keys it made in turn, manage no keys; they still read."""
    target = api_key_create(name="target", customer=acme).api_key
    members_key = api_key_create(
        name="member's", customer=acme, scopes=["read", "write"], created_by=member
    )
    as_members_key = key_client(members_key.plaintext)
    assert mint(as_members_key, scopes=["read"]).status_code == 403
    assert as_members_key.post(f"{KEYS}{target.pk}/revoke/").status_code == 403
    assert as_members_key.get(KEYS).status_code == 200

    owners_key = api_key_create(
        name="owner's", customer=acme, scopes=["read", "write"], created_by=owner
    )
    as_owners_key = key_client(owners_key.plaintext)
    child = mint(as_owners_key, scopes=["read", "write"])
    assert child.status_code == 201
    as_child = key_client(child.json()["key"])
    assert mint(as_child, scopes=["read"]).status_code == 201

    # The owner becomes a member: their key, and the key it made, stop managing keys.
    membership_set(user=owner, customer=acme, role=Membership.Role.MEMBER)
    for client in (as_owners_key, as_child):
        assert mint(client, scopes=["read"]).status_code == 403
        assert client.post(f"{KEYS}{target.pk}/revoke/").status_code == 403
    # Made an owner again, they do again.
    membership_set(user=member, customer=acme, role=Membership.Role.OWNER)
    assert as_members_key.post(f"{KEYS}{target.pk}/revoke/").status_code == 200


def test_a_key_made_on_the_platforms_side_answers_to_no_role(acme, planner, key_client):
    """A planner's key (or a command's) is not a person of the customer's: its scopes decide."""
    by_planner = api_key_create(
        name="handed over", customer=acme, scopes=["read", "write"], created_by=planner
    )
    by_command = api_key_create(name="script", customer=acme, scopes=["read", "write"])
    for created in (by_planner, by_command):
        assert mint(key_client(created.plaintext), scopes=["read"]).status_code == 201
