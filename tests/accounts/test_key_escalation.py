"""A key that creates keys can give away no more than it holds (issue 15: a `read write`
customer key minted `usage:write` keys with no expiry)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from accounts.models import ApiKey
from core.models import AuditEntry

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
KEYS = "/api/v1/api-keys/"


def mint(client, **body):
    return client.post(KEYS, {"name": "minted", "customer": "acme"} | body, format="json")


def test_a_read_write_key_cannot_mint_a_key_with_scopes_it_lacks(acme, make_key, key_client):
    acme.may_report_own_usage = True  # so only the subset rule stands in the way
    acme.save()
    _, plaintext = make_key(customer=acme, scopes=["read", "write"])
    answer = mint(key_client(plaintext), scopes=["read", "usage:write"])
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "scope_escalation"
    assert "lacks usage:write" in error["fields"]["scopes"][0]
    assert ApiKey.objects.count() == 1


def test_a_key_mints_a_subset_of_its_scopes_and_the_child_is_recorded(acme, make_key, key_client):
    parent, plaintext = make_key(customer=acme, scopes=["read", "write"])
    answer = mint(key_client(plaintext), scopes=["read"])
    assert answer.status_code == 201, answer.json()
    child = ApiKey.objects.get(prefix=answer.json()["prefix"])
    assert (child.scopes, child.created_by_key) == (["read"], parent)
    entry = AuditEntry.objects.get(action="api_key.create", object_id=str(child.pk))
    assert entry.actor == f"key:{parent.prefix} (customer:acme)"
    assert entry.after["scopes"] == ["read"]


def test_a_minted_key_never_outlives_the_key_that_minted_it(acme, make_key, key_client):
    expires = timezone.now() + timedelta(days=3)
    _, plaintext = make_key(customer=acme, scopes=["read", "write"], expires_at=expires)
    client = key_client(plaintext)

    later = mint(client, scopes=["read"], expires_in_days=30)
    assert later.status_code == 400
    assert later.json()["error"]["code"] == "expiry_beyond_creator"

    # No expiry asked for: the child inherits its creator's.
    unbounded = mint(client, scopes=["read"])
    assert unbounded.status_code == 201
    child = ApiKey.objects.get(prefix=unbounded.json()["prefix"])
    assert child.expires_at == expires

    sooner = mint(client, scopes=["read"], expires_in_days=1)
    assert sooner.status_code == 201


def test_a_provisioning_key_cannot_mint_customer_keys_with_scopes_it_lacks(
    acme, make_key, key_client
):
    _, plaintext = make_key(service_name="provisioner", scopes=["read", "customers:write"])
    answer = mint(key_client(plaintext), scopes=["read", "write", "admission"])
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "scope_escalation"


def test_people_are_not_bound_by_the_key_rule(acme, owner_client):
    """An owner signed in with a password creates a key with any customer scope it may use."""
    answer = mint(owner_client, scopes=["read", "write", "admission"])
    assert answer.status_code == 201
    assert AuditEntry.objects.get(action="api_key.create").actor == "user:owner"


def test_the_migration_strips_usage_write_from_keys_of_customers_not_allowed(acme, globex):
    """What accounts.0003 does to keys minted before the rule: recorded per key."""
    import importlib
    from types import SimpleNamespace

    from django.apps import apps
    from django.db import connection

    migration = importlib.import_module("accounts.migrations.0003_customer_keys_lose_usage_write")
    globex.may_report_own_usage = True
    globex.save()

    # Keys as they could exist before the rule (written straight to the table).
    def key(customer, prefix, scopes):
        return ApiKey.objects.create(
            name=prefix, customer=customer, prefix=prefix, secret_sha256="0" * 64, scopes=scopes
        )

    both = key(acme, "mu00000000000a", ["read", "usage:write"])
    only = key(acme, "mu00000000000b", ["usage:write"])
    allowed = key(globex, "mu00000000000c", ["read", "usage:write"])
    # The migration only reads the editor's connection; a real schema editor cannot open
    # inside the test's transaction on SQLite.
    migration.forwards(apps, SimpleNamespace(connection=connection))
    for api_key in (both, only, allowed):
        api_key.refresh_from_db()
    assert (both.scopes, both.revoked_at) == (["read"], None)
    assert (only.scopes, only.revoked_at is not None) == ([], True)
    assert allowed.scopes == ["read", "usage:write"]
    # By key (object ids are text: "10" sorts before "9").
    entries = {e.object_id: e for e in AuditEntry.objects.filter(action="api_key.scope_removed")}
    assert set(entries) == {str(both.pk), str(only.pk)}
    assert entries[str(both.pk)].before == {"scopes": ["read", "usage:write"]}
