"""What the tests of Buckets and AsyncBuckets share: a customer id of their own on one model id
(nothing else in Redis uses them), and sync Buckets on the admission Redis."""

import uuid

import pytest
import redis
from django.conf import settings

from capacity.admission.redis_buckets import Buckets
from tests.support.admission import set_rates

MODEL_ID = 880_001


@pytest.fixture
def customer():
    """A customer id of its own, its keys removed afterwards."""
    customer_id = 880_000 + uuid.uuid4().int % 100_000
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    yield customer_id
    stale = list(client.scan_iter(match=f"adm:*:{MODEL_ID}:{customer_id}*"))
    if stale:
        client.delete(*stale)
    client.close()


def sync_buckets(url: str | None = None, **client_kwargs) -> Buckets:
    """Buckets on `url` (the admission Redis by default) with the tests' bucket settings."""
    return Buckets(
        redis.Redis.from_url(url or settings.ADMISSION_REDIS_URL, **client_kwargs),
        burst_seconds=10,
        idle_ttl_seconds=600,
        record_ttl_s=3600,
    )


@pytest.fixture
def redis_user(customer):
    """A Redis ACL user of its own and the customer's limits published: yields a function of a
    password to the admission Redis URL with that user and password; the user is removed
    afterwards."""
    admin = sync_buckets()
    set_rates(admin, {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)
    user = f"admission-test-{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    admin.client.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    base = settings.ADMISSION_REDIS_URL.split("://", 1)[1]
    try:
        yield password, lambda secret: f"redis://{user}:{secret}@{base}"
    finally:
        admin.client.acl_deluser(user)
