import pytest

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_touching_anything(client, django_assert_num_queries):
    with django_assert_num_queries(0):
        response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_is_ok_when_database_and_redis_answer(client):
    response = client.get("/readyz")
    assert response.status_code == 200
    # No tick has completed in this database: unknown, which degrades nothing.
    assert response.json()["checks"] == {
        "database": "ok",
        "redis": "ok",
        "allocation_tick": "unknown",
    }


def test_readyz_names_redis_when_it_does_not_answer_and_stays_ready(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    response = client.get("/readyz")
    # Still ready: admission falls back without Redis, and a Service without web pods
    # would leave the gateways nothing to reach.
    assert response.status_code == 200
    assert response.json()["status"] == "degraded"
    assert response.json()["failed"] == ["redis"]
    assert response.json()["checks"] == {
        "database": "ok",
        "redis": "unavailable",
        "allocation_tick": "unknown",
    }


def test_readyz_tells_anonymous_callers_only_which_dependency_failed(client, settings, caplog):
    settings.REDIS_URL = "redis://cp-secret-host.invalid:6390/0"
    with caplog.at_level("ERROR", logger="core.liveness"):
        response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {
        "status": "degraded",
        "failed": ["redis"],
        "checks": {"database": "ok", "redis": "unavailable", "allocation_tick": "unknown"},
    }
    assert b"cp-secret-host" not in response.content
    assert b"Error" not in response.content
    # The reason is in the server's log instead.
    assert "readyz: Redis does not answer" in caplog.text
    assert "cp-secret-host" in caplog.text or "Error" in caplog.text


def test_readyz_names_the_database_when_it_does_not_answer(client, monkeypatch):
    from django.db import connection

    def refuse(*args, **kwargs):
        from django.db import OperationalError

        raise OperationalError("connection refused")

    # A real unreachable server cannot be swapped in mid-test without losing the test
    # database, so the connection's cursor is made to fail the way psycopg does.
    monkeypatch.setattr(connection, "cursor", refuse)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["failed"] == ["database"]
    assert response.json()["checks"]["database"] == "unavailable"
    assert b"connection refused" not in response.content
