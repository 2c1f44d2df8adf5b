"""Writes and usage batches are throttled per API key (or user), in Redis; reads are not."""

import pytest
import redis
from django.conf import settings as django_settings

from accounts import scopes as S

pytestmark = pytest.mark.django_db


@pytest.fixture
def service(make_key, key_client):
    def make(name="provisioner"):
        _, plaintext = make_key(service_name=name, scopes=[S.READ, S.CATALOG_WRITE])
        return key_client(plaintext)

    return make


def create_gpu_type(client, name):
    return client.post(
        "/api/v1/gpu-types/",
        {"name": name, "memory_gb": 80, "hourly_cost_usd": "2.5"},
        format="json",
    )


def test_the_write_after_the_limit_gets_429_with_retry_after_in_the_error_shape(service, settings):
    settings.API_THROTTLE_WRITES = "3/min"
    client = service()
    for index in range(3):
        assert create_gpu_type(client, f"GPU-{index}").status_code == 201

    refused = create_gpu_type(client, "GPU-3")
    assert refused.status_code == 429
    wait = int(refused["Retry-After"])
    assert 0 < wait <= 60
    error = refused.json()["error"]
    assert error["status"] == 429
    assert error["code"] == "throttled"
    assert error["details"] == {"retry_after_seconds": wait}
    assert client.get("/api/v1/gpu-types/GPU-3/").status_code == 404


def test_reads_are_not_throttled_by_the_write_limit(service, settings):
    settings.API_THROTTLE_WRITES = "1/min"
    client = service()
    assert create_gpu_type(client, "GPU-0").status_code == 201
    assert create_gpu_type(client, "GPU-1").status_code == 429
    for _ in range(5):
        assert client.get("/api/v1/gpu-types/").status_code == 200


def test_one_keys_throttling_does_not_affect_another_key(service, settings):
    settings.API_THROTTLE_WRITES = "1/min"
    first, second = service("first"), service("second")
    assert create_gpu_type(first, "GPU-0").status_code == 201
    assert create_gpu_type(first, "GPU-1").status_code == 429

    assert create_gpu_type(second, "GPU-1").status_code == 201


def test_signed_in_users_are_throttled_per_user(planner_client, settings):
    settings.API_THROTTLE_WRITES = "1/min"
    assert create_gpu_type(planner_client, "GPU-0").status_code == 201
    assert create_gpu_type(planner_client, "GPU-1").status_code == 429


def test_the_count_lives_in_redis_so_every_process_sees_it(service, settings):
    settings.API_THROTTLE_WRITES = "1/min"
    assert create_gpu_type(service(), "GPU-0").status_code == 201
    # Another process would read the same keys: a separate connection sees the count.
    location = django_settings.CACHES["default"]["LOCATION"]
    seen = redis.Redis.from_url(location).keys("cp-cache:*throttle:writes:key:*")
    assert len(seen) == 1


def test_none_turns_the_write_limit_off(service, settings):
    settings.API_THROTTLE_WRITES = None  # what API_THROTTLE_WRITES=none reads as
    client = service()
    for index in range(5):
        assert create_gpu_type(client, f"GPU-{index}").status_code == 201


def test_usage_batches_have_their_own_limit_beside_writes(make_key, key_client, settings):
    settings.API_THROTTLE_WRITES = "1/min"
    settings.API_THROTTLE_USAGE = "2/min"
    _, plaintext = make_key(service_name="gateway", scopes=[S.READ, S.USAGE_WRITE, S.CATALOG_WRITE])
    client = key_client(plaintext)

    answers = [
        client.post("/api/v1/usage/events", {"events": []}, format="json").status_code
        for _ in range(3)
    ]
    assert 429 not in answers[:2]
    assert answers[2] == 429
    # Usage did not use up the write limit.
    assert create_gpu_type(client, "GPU-0").status_code == 201


def test_admission_decisions_are_not_counted_as_writes(make_key, key_client, acme, settings):
    settings.API_THROTTLE_WRITES = "1/min"
    _, plaintext = make_key(customer=acme, scopes=[S.ADMISSION])
    client = key_client(plaintext)
    for _ in range(3):
        answer = client.post("/api/v1/admission", {"model": "nope"}, format="json")
        assert answer.json().get("error", {}).get("code") != "throttled"


def test_the_schema_documents_the_429s_of_throttled_operations(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    paths = schema["paths"]
    throttled = paths["/api/v1/gpu-types/"]["post"]["responses"]["429"]
    assert "Retry-After" in throttled["headers"]
    assert "429" in paths["/api/v1/usage/events"]["post"]["responses"]
    assert "429" in paths["/api/v1/deployments/{name}/"]["patch"]["responses"]
    assert "429" not in paths["/api/v1/gpu-types/"]["get"]["responses"]
    # Admission's 429 is its own refusal, not the throttle's.
    admission_429 = paths["/api/v1/admission"]["post"]["responses"]["429"]
    assert "Retry-After" not in admission_429.get("headers", {})
