from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from accounts.keys import hash_secret
from accounts.models import ApiKey

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def test_the_database_never_holds_the_secret(make_key, acme):
    api_key, plaintext = make_key(customer=acme)
    prefix, secret = plaintext.split(".", 1)

    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM accounts_apikey WHERE id = %s", [api_key.pk])
        row = cursor.fetchone()
    stored = " ".join(str(value) for value in row)
    assert prefix in stored
    assert secret not in stored
    assert hash_secret(secret) in stored


def test_a_key_authenticates_and_its_last_used_at_moves(make_key, acme, key_client):
    api_key, plaintext = make_key(customer=acme)
    assert api_key.last_used_at is None

    response = key_client(plaintext).get("/api/v1/me")

    assert response.status_code == 200
    assert response.json()["customers"] == [{"customer": "acme", "role": "key"}]
    api_key.refresh_from_db()
    assert api_key.last_used_at is not None
    assert timezone.now() - api_key.last_used_at < timedelta(seconds=10)

    # An old timestamp moves on the next use.
    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=timezone.now() - timedelta(hours=1))
    key_client(plaintext).get("/api/v1/me")
    api_key.refresh_from_db()
    assert timezone.now() - api_key.last_used_at < timedelta(seconds=10)


def test_a_revoked_key_gets_401(make_key, acme, key_client, owner_client):
    api_key, plaintext = make_key(customer=acme)

    response = owner_client.post(f"/api/v1/api-keys/{api_key.pk}/revoke/")
    assert response.status_code == 200
    assert response.json()["revoked_at"] is not None

    response = key_client(plaintext).get("/api/v1/me")
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]


def test_an_expired_key_gets_401(make_key, acme, key_client):
    api_key, plaintext = make_key(customer=acme)
    ApiKey.objects.filter(pk=api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    response = key_client(plaintext).get("/api/v1/me")

    assert response.status_code == 401
    assert "expired" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "header",
    [
        "Bearer nodot",
        "Bearer mu000000000000.wrong-secret",
        "Bearer a.b c",
        "Bearer",
    ],
)
def test_a_wrong_or_malformed_key_gets_401(make_key, acme, anon, header):
    make_key(customer=acme)
    response = anon.get("/api/v1/me", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    assert response.json()["error"]["status"] == 401


def test_a_right_prefix_with_a_wrong_secret_gets_401(make_key, acme, key_client):
    _, plaintext = make_key(customer=acme)
    prefix = plaintext.split(".")[0]
    response = key_client(f"{prefix}.not-the-secret").get("/api/v1/me")
    assert response.status_code == 401


def test_the_key_is_shown_once_at_creation_and_never_in_lists(owner_client, acme):
    response = owner_client.post(
        "/api/v1/api-keys/", {"name": "ci", "customer": "acme"}, format="json"
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    plaintext = body["key"]
    assert plaintext.startswith(body["prefix"] + ".")

    listing = owner_client.get("/api/v1/api-keys/").json()
    assert listing["count"] == 1
    assert "key" not in listing["results"][0]
    detail = owner_client.get(f"/api/v1/api-keys/{body['id']}/").json()
    assert "key" not in detail
    assert plaintext.split(".")[1] not in str(listing) + str(detail)


def test_an_expiring_key_can_be_created_through_the_api(owner_client, acme):
    response = owner_client.post(
        "/api/v1/api-keys/",
        {"name": "short", "customer": "acme", "expires_in_days": 7, "scopes": ["read"]},
        format="json",
    )
    assert response.status_code == 201
    expires_at = ApiKey.objects.get(pk=response.json()["id"]).expires_at
    assert timedelta(days=6, hours=23) < expires_at - timezone.now() <= timedelta(days=7)


def test_a_customer_key_cannot_take_service_scopes(owner_client, acme):
    response = owner_client.post(
        "/api/v1/api-keys/",
        {"name": "greedy", "customer": "acme", "scopes": ["catalog:write"]},
        format="json",
    )
    assert response.status_code == 400
    assert "scopes" in response.json()["error"]["fields"]
    assert not ApiKey.objects.exists()


def test_a_viewer_cannot_create_keys(acme, key_client):
    from tests.support.factories import MembershipFactory

    viewer = MembershipFactory(customer=acme, role="viewer").user
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_login(viewer)
    response = client.post("/api/v1/api-keys/", {"name": "x", "customer": "acme"}, format="json")
    assert response.status_code == 403
    assert not ApiKey.objects.exists()


def test_only_planners_create_service_keys(owner_client, planner_client):
    refused = owner_client.post(
        "/api/v1/api-keys/", {"name": "gw", "service_name": "gateway"}, format="json"
    )
    assert refused.status_code == 403

    created = planner_client.post(
        "/api/v1/api-keys/",
        {"name": "gw", "service_name": "gateway", "scopes": ["read", "usage:write"]},
        format="json",
    )
    assert created.status_code == 201
    assert created.json()["service_name"] == "gateway"
    assert created.json()["scopes"] == ["read", "usage:write"]


def test_create_api_key_prints_a_working_key_once(acme, key_client, capsys):
    call_command("create_api_key", "--customer", "acme", "--scopes", "read", "--quiet")
    plaintext = capsys.readouterr().out.strip()

    assert key_client(plaintext).get("/api/v1/me").status_code == 200
    api_key = ApiKey.objects.get()
    assert api_key.scopes == ["read"]
    assert plaintext.split(".")[1] not in str(api_key.__dict__)


def test_create_api_key_for_a_service_with_expiry(capsys, db):
    call_command("create_api_key", "--service", "gateway", "--expires", "30")
    out = capsys.readouterr().out
    assert "service:gateway" in out
    assert "cannot be shown again" in out
    api_key = ApiKey.objects.get()
    assert api_key.service_name == "gateway"
    assert api_key.expires_at is not None


def test_create_api_key_refuses_an_unknown_customer(db):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="No customer with slug 'nope'"):
        call_command("create_api_key", "--customer", "nope")
