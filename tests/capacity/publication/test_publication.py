"""What gateways read from Redis (docs/gateway-contract.md): the four documents after a tick,
and again at once after a key is revoked, an entitlement or a deployment changes, a replica
turns ready or a model degrades; and a Redis outage never breaks the write that caused it."""

import hashlib
import json

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from accounts import scopes as S
from capacity.admission import gate as admission
from capacity.allocation.tick import allocation_tick
from capacity.catalog.services import deployment_update
from capacity.health.degradation import evaluate_all
from capacity.health.services import degradation_policy_save
from capacity.models import Deployment, Replica
from capacity.publication.publish import publish_gateway_state
from capacity.selling.entitlements import entitlements_set
from tests.support.processes import free_port

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

DOCUMENTS = ("gw:v1:keys", "gw:v1:models", "gw:v1:entitlements", "gw:v1:meta")


@pytest.fixture
def gateway_redis(settings):
    admission.reset()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL, decode_responses=True)
    client.delete(*DOCUMENTS)
    yield client
    admission.reset()


def read(client, key: str) -> dict:
    return {field: json.loads(value) for field, value in client.hgetall(key).items()}


def ready_replica(deployment, url="http://10.0.0.1:8000", **fields):
    values = {"state": Replica.State.HEALTHY, "last_ok_at": timezone.now()} | fields
    return Replica.objects.create(deployment=deployment, key=url, url=url, **values)


def test_a_tick_publishes_keys_models_entitlements_and_a_growing_version(
    gateway_redis, sellable, served_model, acme, make_key
):
    deployment = Deployment.objects.get()
    ready_replica(deployment)
    ready_replica(deployment, "http://10.0.0.2:8000", state=Replica.State.UNHEALTHY)
    ready_replica(deployment, "http://10.0.0.3:8000", last_ok_at=None)  # never answered yet
    api_key, plaintext = make_key(customer=acme, scopes=[S.READ])
    entitlements_set(customer=acme, served_models=[served_model], actor="test")

    allocation_tick()
    first = int(gateway_redis.hget("gw:v1:meta", "version"))
    allocation_tick()

    assert int(gateway_redis.hget("gw:v1:meta", "version")) == first + 1
    assert float(gateway_redis.hget("gw:v1:meta", "published_at")) > 0
    published_key = read(gateway_redis, "gw:v1:keys")[api_key.prefix]
    secret = plaintext.partition(".")[2]
    assert published_key == {
        "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(),
        "kind": "customer",
        "customer_id": acme.pk,
        "customer": "acme",
        "scopes": [S.READ],
        "expires_at": None,
        "revoked": False,
    }
    model = read(gateway_redis, "gw:v1:models")["llama-8b"]
    assert model["model_id"] == served_model.pk
    assert model["engine_model_id"] == served_model.engine_model_id
    assert model["cost_model"]["weights_replica_seconds"] == sellable.weights_replica_seconds
    assert model["cost_model"]["replica_mu_per_minute"] == 100.0
    assert model["output_cap_tokens"] is None  # no completed usage yet
    assert model["bytes_per_token"] == 4.0
    assert model["degradation"] == {
        "level": 0,
        "refuse_best_effort": False,
        "shed_tiers": None,
        "max_tokens_cap": None,
        "fallback_model": None,
    }
    # Only the healthy replica that answered its probe is routed to.
    assert model["replicas"] == [
        {
            "endpoint": "http://10.0.0.1:8000",
            "deployment": deployment.name,
            "gpu_type": "H100-80GB",
            "priority_scheduling": False,
        }
    ]
    assert read(gateway_redis, "gw:v1:entitlements") == {str(acme.pk): ["llama-8b"]}
    assert read(gateway_redis, "gw:v1:customers") == {"acme": acme.pk}
    assert read(gateway_redis, "gw:v1:customer_tiers") == {str(acme.pk): "standard"}
    # The admission rule's parameters, so a gateway admits with the control plane's burst.
    assert float(gateway_redis.hget("gw:v1:meta", "admission_burst_seconds")) == float(
        django_settings.ADMISSION_BURST_SECONDS
    )


def test_a_revoked_key_is_published_revoked_as_soon_as_the_revocation_commits(
    gateway_redis, acme, make_key, owner_client, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        api_key, _ = make_key(customer=acme)
    assert read(gateway_redis, "gw:v1:keys")[api_key.prefix]["revoked"] is False
    version = int(gateway_redis.hget("gw:v1:meta", "version"))

    with django_capture_on_commit_callbacks(execute=True):
        response = owner_client.post(f"/api/v1/api-keys/{api_key.pk}/revoke/")

    assert response.status_code == 200, response.content
    assert read(gateway_redis, "gw:v1:keys")[api_key.prefix]["revoked"] is True
    assert int(gateway_redis.hget("gw:v1:meta", "version")) > version


def test_keys_revoked_long_ago_are_no_longer_published(gateway_redis, acme, make_key, settings):
    old, _ = make_key(customer=acme)
    recent, _ = make_key(customer=acme)
    old.revoked_at = timezone.now() - timezone.timedelta(
        seconds=settings.PUBLICATION_REVOKED_KEYS_SECONDS + 60
    )
    old.save()
    recent.revoked_at = timezone.now()
    recent.save()

    publish_gateway_state(reason="test")

    keys = read(gateway_redis, "gw:v1:keys")
    assert old.prefix not in keys
    assert keys[recent.prefix]["revoked"] is True


def test_a_deployment_change_and_a_degradation_are_published_after_commit(
    gateway_redis, sellable, served_model, django_capture_on_commit_callbacks
):
    deployment = Deployment.objects.get()
    ready_replica(deployment)

    with django_capture_on_commit_callbacks(execute=True):
        deployment_update(deployment=deployment, priority_scheduling=True)
    (replica,) = read(gateway_redis, "gw:v1:models")["llama-8b"]["replicas"]
    assert replica["priority_scheduling"] is True

    with django_capture_on_commit_callbacks(execute=True):
        degradation_policy_save(served_model=served_model, window_seconds=1, max_tokens_cap=256)
        Replica.objects.update(state=Replica.State.UNHEALTHY)
        start = timezone.now()
        evaluate_all(now=start)
        evaluate_all(now=start + timezone.timedelta(seconds=2))

    model = read(gateway_redis, "gw:v1:models")["llama-8b"]
    # Level 1 after one window: the first tier in shed order only.
    assert model["degradation"]["level"] == 1
    assert model["degradation"]["shed_tiers"] == ["free"]
    # Still true, for a gateway that does not read shed_tiers: it refuses all, as before.
    assert model["degradation"]["refuse_best_effort"] is True
    assert model["replicas"] == []  # unhealthy replicas are not routed to


def test_redis_down_never_breaks_the_write_and_is_counted(
    settings, acme, served_model, planner_client, django_capture_on_commit_callbacks
):
    from capacity.telemetry import metrics

    settings.ADMISSION_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    admission.reset()
    failed = metrics.GATEWAY_PUBLICATIONS.labels(result="failed")
    before = failed._value.get()
    try:
        with django_capture_on_commit_callbacks(execute=True):
            response = planner_client.put(
                "/api/v1/customers/acme/entitlements", {"models": ["llama-8b"]}, format="json"
            )
        assert response.status_code == 200
        assert response.json()["models"] == ["llama-8b"]
        assert publish_gateway_state(reason="test") is None
        assert failed._value.get() >= before + 2
    finally:
        admission.reset()


def test_changes_saved_in_the_admin_are_published_when_they_commit(
    gateway_redis, sellable, served_model, acme, client, django_user_model,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    from django.urls import reverse

    deployment = Deployment.objects.get()
    ready_replica(deployment)
    publish_gateway_state(reason="test")
    gpu_type = deployment.gpu_pool.gpu_type
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)

    with django_capture_on_commit_callbacks(execute=True):
        renamed = client.post(
            reverse("admin:capacity_gputype_change", args=[gpu_type.pk]),
            {"name": "H100-SXM", "memory_gb": 80, "hourly_cost_usd": "4.25"},
        )
        slug = client.post(
            reverse("admin:accounts_customer_change", args=[acme.pk]),
            {"slug": "acme-corp", "name": acme.name, "tier": acme.tier,
             "memberships-TOTAL_FORMS": 0, "memberships-INITIAL_FORMS": 0},
        )  # fmt: skip

    assert (renamed.status_code, slug.status_code) == (302, 302)
    (replica,) = read(gateway_redis, "gw:v1:models")["llama-8b"]["replicas"]
    assert replica["gpu_type"] == "H100-SXM"  # no tick ran
    assert read(gateway_redis, "gw:v1:customers") == {"acme-corp": acme.pk}
