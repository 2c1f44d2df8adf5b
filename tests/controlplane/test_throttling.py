"""Writes, usage batches and reads are throttled per API key (or user), in Redis; reads that
build a document (invoice PDFs and CSVs, the usage CSV, the API's schema) have a tighter limit
of their own, and an anonymous reader of the schema is counted per client address."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest
import redis
from django.conf import settings as django_settings
from rest_framework.test import APIClient

from accounts import scopes as S
from billing.generation import invoice_generate
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.models import Reservation

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
    assert "429" in paths["/api/v1/gpu-types/"]["get"]["responses"]
    assert "429" in paths["/api/v1/usage/events"]["get"]["responses"]
    pdf_throttled = paths["/api/v1/invoices/{id}/pdf/"]["get"]["responses"]["429"]
    assert "API_THROTTLE_EXPORTS" in pdf_throttled["description"]
    # Admission's 429 is its own refusal, not the throttle's.
    admission_429 = paths["/api/v1/admission"]["post"]["responses"]["429"]
    assert "Retry-After" not in admission_429.get("headers", {})


# --- Reads --------------------------------------------------------------------------------------


def test_the_read_after_the_read_limit_gets_429_and_another_key_still_reads(service, settings):
    settings.API_THROTTLE_READS = "3/min"
    client, other = service("first"), service("second")
    answers = [client.get("/api/v1/gpu-types/").status_code for _ in range(4)]
    assert answers == [200, 200, 200, 429]
    refused = client.get("/api/v1/models/")
    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= 60
    assert refused.json()["error"]["code"] == "throttled"

    assert other.get("/api/v1/gpu-types/").status_code == 200
    # Reads did not use up the write limit.
    assert create_gpu_type(client, "GPU-0").status_code == 201


def test_usage_receipts_are_counted_as_reads(make_key, key_client, acme, settings):
    settings.API_THROTTLE_READS = "2/min"
    _, plaintext = make_key(customer=acme, scopes=[S.READ])
    client = key_client(plaintext)
    answers = [client.get("/api/v1/usage/events").status_code for _ in range(3)]
    assert answers == [200, 200, 429]


def test_none_turns_the_read_limits_off(service, settings):
    settings.API_THROTTLE_READS = None
    settings.API_THROTTLE_EXPORTS = None
    client = service()
    for _ in range(5):
        assert client.get("/api/v1/gpu-types/").status_code == 200


@pytest.fixture
def acme_invoice(acme, served_model):
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=10,
        starts_at=datetime(2026, 11, 1, tzinfo=UTC),
        status="active",
    )
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    invoice_generate(period="2026-11")
    return Invoice.objects.get(customer=acme)


def test_invoice_downloads_have_a_tighter_limit_beside_reads(
    make_key, key_client, acme, acme_invoice, settings
):
    """A PDF takes most of a second to build: a key gets far fewer of them than of reads."""
    settings.API_THROTTLE_READS = "100/min"
    settings.API_THROTTLE_EXPORTS = "2/min"
    _, plaintext = make_key(customer=acme, scopes=[S.READ])
    client = key_client(plaintext)
    base = f"/api/v1/invoices/{acme_invoice.pk}"
    assert client.get(f"{base}/pdf/").status_code == 200
    assert client.get(f"{base}/csv/").status_code == 200
    refused = client.get(f"{base}/pdf/")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "throttled"
    assert client.get("/api/v1/usage/events/csv").status_code == 429

    # The JSON reads go on: they have the reads' limit.
    assert client.get(f"{base}/").status_code == 200
    assert client.get("/api/v1/invoices/").status_code == 200


def test_the_portals_invoice_downloads_share_the_users_export_limit(
    owner_client, acme, acme_invoice, settings
):
    settings.API_THROTTLE_EXPORTS = "2/min"
    page = f"/portal/acme/invoices/{acme_invoice.pk}"
    assert owner_client.get(f"{page}/download/pdf").status_code == 200
    assert owner_client.get(f"/api/v1/invoices/{acme_invoice.pk}/csv/").status_code == 200
    refused = owner_client.get(f"{page}/download/csv")
    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= 60
    # The invoice's page itself is not an export.
    assert owner_client.get(f"{page}/").status_code == 200


def test_the_schema_is_an_export_counted_per_client_address_for_anonymous_readers(settings):
    """Anyone may read the API's schema (it is the same for every install), but it is ~1 MB
    built per request: an anonymous reader is counted by its address."""
    settings.API_THROTTLE_EXPORTS = "2/min"
    reader = APIClient(REMOTE_ADDR="203.0.113.7")
    answers = [reader.get("/api/schema/").status_code for _ in range(3)]
    assert answers == [200, 200, 429]

    elsewhere = APIClient(REMOTE_ADDR="203.0.113.8")
    assert elsewhere.get("/api/schema/").status_code == 200
