import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from accounts.models import ApiKey, Customer
from accounts.principals import user_is_planner
from capacity.models import Deployment

pytestmark = pytest.mark.django_db


def test_create_planner_makes_a_staff_planner_from_the_environment(monkeypatch, client):
    monkeypatch.setenv("PLANNER_PASSWORD", "a-Strong-passphrase-42")
    call_command("create_planner", "alice")

    user = get_user_model().objects.get(username="alice")
    assert user.is_staff
    assert user_is_planner(user)
    logged_in = client.post("/login/", {"username": "alice", "password": "a-Strong-passphrase-42"})
    assert logged_in.status_code == 302
    assert client.get("/api/v1/me").json()["is_planner"] is True


def test_create_planner_rejects_a_weak_password(monkeypatch):
    monkeypatch.setenv("PLANNER_PASSWORD", "123")
    with pytest.raises(CommandError, match="Password rejected"):
        call_command("create_planner", "bob")
    assert not get_user_model().objects.filter(username="bob").exists()


def test_seed_demo_can_run_twice_and_leaves_only_the_fresh_keys_working(capsys, key_client):
    call_command("seed_demo")
    first = capsys.readouterr().out
    call_command("seed_demo")
    second = capsys.readouterr().out

    assert Customer.objects.count() == 2
    assert Deployment.objects.count() == 4
    old_key = first.split("Customer acme     key: ")[1].split()[0]
    new_key = second.split("Customer acme     key: ")[1].split()[0]
    assert key_client(old_key).get("/api/v1/me").status_code == 401
    me = key_client(new_key).get("/api/v1/me").json()
    assert me["customers"] == [{"customer": "acme", "role": "key"}]
    assert ApiKey.objects.filter(revoked_at__isnull=True).count() == 3
    # The demo's gateway sends requests for the customers it names: its key holds admission.
    gateway = ApiKey.objects.get(service_name="demo-gateway", revoked_at__isnull=True)
    assert {"usage:write", "admission"} <= set(gateway.scopes)
    # The demo sells acme 300 MU/min once, against the cost model fitted from the shipped table.
    from capacity.models import Reservation

    assert list(Reservation.objects.values_list("customer__slug", "mu_per_minute")) == [
        ("acme", 300)
    ]
    # Every model is priced once, so acme's invoice for the month bills its reservation, and
    # its keep-warm premium.
    from billing.generation import build_lines
    from billing.models import RateCard

    assert RateCard.objects.count() == 2
    acme = Customer.objects.get(slug="acme")
    _, lines, result = build_lines(timezone.now().date(), customers=[acme])
    assert sorted(line.kind for line in lines[acme.pk]) == ["commitment", "keep_warm"]
    assert result.unpriced == []


def test_list_gateway_keys_names_the_live_service_keys_a_gateway_refuses(capsys, acme):
    from datetime import timedelta

    from accounts.services import api_key_create

    gateway = api_key_create(
        name="edge", service_name="gateway", scopes=["read", "usage:write", "admission"]
    ).api_key
    dashboard = api_key_create(name="grafana", service_name="dashboard", scopes=["read"]).api_key
    # Keys that authenticate nowhere are no one's concern: expired, revoked, or a customer's.
    expired = api_key_create(
        name="old", service_name="dashboard", expires_at=timezone.now() + timedelta(days=1)
    ).api_key
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(days=1))
    customers = api_key_create(name="app", customer=acme, scopes=["read"]).api_key

    call_command("list_gateway_keys")
    accepted, refused = capsys.readouterr().out.split("Service keys a gateway refuses")
    assert "accepts (admission): 1" in accepted and gateway.prefix in accepted
    assert "(no admission): 1" in refused
    assert f"{dashboard.prefix}  service:dashboard  'grafana'  scopes: read  last used: never" in (
        refused
    )
    assert "create_api_key --service NAME --scopes read usage:write admission" in refused
    for api_key in (expired, customers):
        assert api_key.prefix not in accepted + refused

    ApiKey.objects.filter(pk=dashboard.pk).update(revoked_at=timezone.now())
    call_command("list_gateway_keys")
    assert capsys.readouterr().out.rstrip().endswith("(no admission): 0\n  none")
