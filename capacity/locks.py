"""One runner at a time for periodic work (the allocation tick, the health probes): a
PostgreSQL advisory lock, or a Redis lock on SQLite (the demo)."""

from contextlib import contextmanager

from django.conf import settings
from django.db import connection


@contextmanager
def exclusive(name: str, advisory_key: int, *, timeout_seconds: int = 120):
    """Yields whether this caller holds the lock; never waits for it."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [advisory_key])
            taken = cursor.fetchone()[0]
        try:
            yield taken
        finally:
            if taken:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s)", [advisory_key])
        return
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    lock = client.lock(f"controlplane:{name}", timeout=timeout_seconds, blocking=False)
    taken = lock.acquire(blocking=False)
    try:
        yield taken
    finally:
        if taken:
            lock.release()
