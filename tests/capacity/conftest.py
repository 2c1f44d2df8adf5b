import pytest
import redis

from capacity.admission import gate as admission
from capacity.admission.gateways import SPOOL, WORKERS


@pytest.fixture
def clean_admission(settings):
    """Admission from a clean slate: no cached models or limits in this process, no admission
    keys in Redis, and none of what gateways report that admission's side reads (the usage
    spool, the workers' heartbeats); yields the admission Redis client.

    The gateway keys matter: a gateway an earlier test of the same worker started may spool
    its last usage after that test's clean-up (its control plane gone), and the reaper skips a
    pass while the spool is not empty (a reaper test failed so, depending on test order)."""
    admission.reset()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    keys = [*client.scan_iter("adm:*"), SPOOL, WORKERS]
    client.delete(*keys)
    yield client
    admission.reset()
