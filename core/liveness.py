"""Liveness and readiness for the orchestrator.

/healthz answers as long as the process serves requests: it touches nothing, so a slow
database never gets a healthy web process killed. /readyz checks what a request needs: the
database (503 without it). Redis down is reported but still 200 ("degraded"): admission has
its Redis-down fallback (ADMISSION_FALLBACK_PROCESSES) and the API serves from the database,
so taking every web pod out of its Service when Redis fails would turn a degraded control
plane into none at all. The checks apps register in `degrading_checks` degrade it the same way
(a stale allocation tick: `allocation_tick: stale`, capacity.allocation.heartbeat). Both
answer anyone: /readyz names the dependency that failed and nothing more; the reason (host
names, driver messages) goes to the log.
"""

import logging
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.http import require_GET

READY_TIMEOUT_SECONDS = 2.0
logger = logging.getLogger(__name__)


@require_GET
def healthz(request):
    """200 while the process serves requests; it touches nothing."""
    return JsonResponse({"status": "ok"})


def _check_database() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:  # any failure means "not ready"; the reason is logged, not answered
        logger.exception("readyz: the database does not answer")
        return False
    return True


def _check_redis() -> bool:
    client = redis.Redis.from_url(
        settings.REDIS_URL,
        socket_connect_timeout=READY_TIMEOUT_SECONDS,
        socket_timeout=READY_TIMEOUT_SECONDS,
    )
    try:
        client.ping()
    except Exception:  # any failure means "not ready"; the reason is logged, not answered
        logger.exception("readyz: Redis does not answer")
        return False
    finally:
        client.close()
    return True


# Checks the apps add (their AppConfig.ready): name -> a function answering "ok", "unknown"
# or the failed state's name. Each may only degrade /readyz, never fail it, and runs only when
# the database answers. The project shell imports no app; the apps register here.
degrading_checks: dict[str, Callable[[], str]] = {}


def _degrading(name: str, check: Callable[[], str]) -> str:
    try:
        return check()
    except Exception:  # the database check reports the database; the reason goes to the log
        logger.exception("readyz: the %s check failed", name)
        return "unknown"


@require_GET
def readyz(request):
    """503 without the database; 200 "degraded" naming what else failed; else 200 "ok"."""
    database = _check_database()
    checks = {
        "database": "ok" if database else "unavailable",
        "redis": "ok" if _check_redis() else "unavailable",
    }
    if database:
        for name, check in degrading_checks.items():
            checks[name] = _degrading(name, check)
    failed = sorted(name for name, state in checks.items() if state not in ("ok", "unknown"))
    if "database" in failed:
        return JsonResponse(
            {"status": "unavailable", "failed": failed, "checks": checks}, status=503
        )
    if failed:
        return JsonResponse({"status": "degraded", "failed": failed, "checks": checks})
    return JsonResponse({"status": "ok", "checks": checks})
