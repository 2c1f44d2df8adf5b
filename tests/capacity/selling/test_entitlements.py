"""Entitlements: which models a customer's keys may use. Set by planners and provisioning
services, read by the customer itself and no one else, audited, and published to gateways."""

import importlib
import json

import pytest
import redis
from django.apps import apps

from accounts import scopes as S
from capacity.models import Entitlement, UsageMinute
from capacity.selling.reservations import reservation_create
from core.models import AuditEntry
from tests.support.factories import ServedModelFactory

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

URL = "/api/v1/customers/{}/entitlements"


@pytest.fixture
def qwen(gpu_type):
    return ServedModelFactory(name="qwen-72b", reference_gpu_type=gpu_type)


@pytest.fixture
def gateway_redis(settings):
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL, decode_responses=True)
    client.delete("gw:v1:entitlements", "gw:v1:keys", "gw:v1:models", "gw:v1:meta")
    return client


def test_a_planner_sets_the_list_the_customer_reads_and_gateways_receive(
    planner_client, owner_client, acme, served_model, qwen, gateway_redis,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    assert owner_client.get(URL.format("acme")).json() == {"customer": "acme", "models": []}

    with django_capture_on_commit_callbacks(execute=True):
        response = planner_client.put(
            URL.format("acme"), {"models": ["qwen-72b", "llama-8b"]}, format="json"
        )

    assert response.status_code == 200, response.content
    assert response.json() == {"customer": "acme", "models": ["llama-8b", "qwen-72b"]}
    assert owner_client.get(URL.format("acme")).json()["models"] == ["llama-8b", "qwen-72b"]
    published = gateway_redis.hget("gw:v1:entitlements", str(acme.pk))
    assert json.loads(published) == ["llama-8b", "qwen-72b"]
    entry = AuditEntry.objects.get(action="customer.entitlements")
    assert entry.actor == "user:planner"
    assert (entry.before, entry.after) == (
        {"models": []},
        {"models": ["llama-8b", "qwen-72b"]},
    )

    # Withdrawing everything leaves the customer with no model, and no field at the gateway.
    with django_capture_on_commit_callbacks(execute=True):
        response = planner_client.put(URL.format("acme"), {"models": []}, format="json")
    assert response.json()["models"] == []
    assert gateway_redis.hget("gw:v1:entitlements", str(acme.pk)) is None


def test_an_unknown_model_is_refused_naming_the_field_and_nothing_changes(
    planner_client, acme, served_model
):
    planner_client.put(URL.format("acme"), {"models": ["llama-8b"]}, format="json")

    response = planner_client.put(
        URL.format("acme"), {"models": ["llama-8b", "gpt-9"]}, format="json"
    )

    assert response.status_code == 400
    assert "gpt-9" in response.json()["error"]["fields"]["models"][0]
    assert planner_client.get(URL.format("acme")).json()["models"] == ["llama-8b"]
    missing = planner_client.put(URL.format("acme"), {}, format="json")
    assert missing.status_code == 400 and "models" in missing.json()["error"]["fields"]
    wrong_type = planner_client.put(URL.format("acme"), {"models": "llama-8b"}, format="json")
    assert wrong_type.status_code == 400 and "models" in wrong_type.json()["error"]["fields"]


def test_customers_read_only_their_own_and_never_write(
    planner_client, owner_client, outsider_client, acme_key_client, globex, served_model
):
    planner_client.put(URL.format("globex"), {"models": ["llama-8b"]}, format="json")

    # Another customer's list is hidden as if it did not exist.
    assert owner_client.get(URL.format("globex")).status_code == 404
    assert acme_key_client.get(URL.format("globex")).status_code == 404
    assert outsider_client.get(URL.format("globex")).json()["models"] == ["llama-8b"]
    # Not even its own: a customer cannot entitle itself to a model.
    body = {"models": ["llama-8b"]}
    assert owner_client.put(URL.format("acme"), body, format="json").status_code == 403
    assert acme_key_client.put(URL.format("acme"), body, format="json").status_code == 403
    assert owner_client.get(URL.format("acme")).json()["models"] == []


def test_a_provisioning_service_with_customers_write_sets_them(
    make_key, key_client, acme, served_model
):
    _, provisioner = make_key(service_name="provisioner", scopes=[S.CUSTOMERS_WRITE])
    _, reader = make_key(service_name="reader", scopes=[S.READ])
    body = {"models": ["llama-8b"]}

    assert key_client(reader).put(URL.format("acme"), body, format="json").status_code == 403
    response = key_client(provisioner).put(URL.format("acme"), body, format="json")

    assert response.status_code == 200
    assert key_client(reader).get(URL.format("acme")).json()["models"] == ["llama-8b"]
    assert Entitlement.objects.get().granted_by.startswith("key:")
    assert key_client(provisioner).put(URL.format("nobody"), body, format="json").status_code == 404


def test_selling_a_reservation_entitles_the_customer_to_its_model(
    planner_client, acme, served_model, sellable
):
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=10, actor="t")

    assert planner_client.get(URL.format("acme")).json()["models"] == ["llama-8b"]


def test_the_migration_entitles_customers_to_what_they_reserved_or_used(
    acme, globex, served_model, qwen, sellable
):
    from django.utils import timezone

    reservation_create(customer=acme, served_model=served_model, mu_per_minute=10, actor="t")
    Entitlement.objects.all().delete()  # as before the migration
    UsageMinute.objects.create(customer=globex, served_model=qwen, minute=timezone.now())
    migration = importlib.import_module(
        "capacity.migrations.0016_entitle_customers_to_what_they_use"
    )

    migration.entitle_existing(apps, None)

    assert set(Entitlement.objects.values_list("customer__slug", "served_model__name")) == {
        ("acme", "llama-8b"),
        ("globex", "qwen-72b"),
    }
