"""Liveness and readiness for the orchestrator.

/healthz answers as long as the process serves requests: it touches nothing, so a slow
database never gets a healthy web process killed. /readyz checks what a request needs.
"""

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.http import require_GET

READY_TIMEOUT_SECONDS = 2.0


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as error:  # any failure means "not ready"; the reason is reported
        return f"{type(error).__name__}: {error}".strip()
    return None


def _check_redis() -> str | None:
    client = redis.Redis.from_url(
        settings.REDIS_URL,
        socket_connect_timeout=READY_TIMEOUT_SECONDS,
        socket_timeout=READY_TIMEOUT_SECONDS,
    )
    try:
        client.ping()
    except Exception as error:  # any failure means "not ready"; the reason is reported
        return f"{type(error).__name__}: {error}".strip()
    finally:
        client.close()
    return None


@require_GET
def readyz(request):
    failures = {
        name: reason
        for name, reason in (("database", _check_database()), ("redis", _check_redis()))
        if reason is not None
    }
    if failures:
        return JsonResponse(
            {
                "status": "unavailable",
                "failed": sorted(failures),
                "reasons": failures,
            },
            status=503,
        )
    return JsonResponse({"status": "ok", "checks": {"database": "ok", "redis": "ok"}})
