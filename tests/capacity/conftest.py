import pytest
import redis

from capacity.admission import gate as admission


@pytest.fixture
def clean_admission(settings):
    """Admission from a clean slate: no cached models or limits in this process, no admission
    keys in Redis; yields the admission Redis client."""
    admission.reset()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    keys = list(client.scan_iter("adm:*"))
    if keys:
        client.delete(*keys)
    yield client
    admission.reset()
