"""Settings come from the environment; a malformed value stops start-up naming the variable."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_LIKE = {
    "DEBUG": "0",
    "SECRET_KEY": "a-long-random-production-like-secret-" + "q7Z" * 12,
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/controlplane",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    "ALLOWED_HOSTS": "cp.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://cp.example.com",
}


def run_manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        key: value
        for key, value in os.environ.items()
        if key
        not in {
            "DEBUG",
            "SECRET_KEY",
            "DATABASE_URL",
            "REDIS_URL",
            "ALLOWED_HOSTS",
            "CSRF_TRUSTED_ORIGINS",
            "SECURE_SSL_REDIRECT",
            "TRUSTED_PROXY_COUNT",
            "CONTROLPLANE_BUILD_STEP",
            "STATIC_ROOT",
        }
    }
    environment.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("DEBUG", "maybe", "DEBUG='maybe' is not a boolean"),
        ("DATABASE_URL", "mysqlx://nowhere", "DATABASE_URL"),
        ("REDIS_URL", "http://127.0.0.1:6379", "REDIS_URL='http://127.0.0.1:6379' is not a Redis"),
        ("REDIS_URL", "redis://127.0.0.1:notaport/0", "REDIS_URL"),
        ("CSRF_TRUSTED_ORIGINS", "cp.example.com", "CSRF_TRUSTED_ORIGINS"),
        ("SECURE_HSTS_SECONDS", "a year", "SECURE_HSTS_SECONDS='a year' is not an integer"),
        ("CELERY_TASK_TIME_LIMIT", "0", "CELERY_TASK_TIME_LIMIT=0 must be at least 1"),
        ("OUTBOUND_ALLOWED_HOSTS", "10.0.0.1/8", "OUTBOUND_ALLOWED_HOSTS: '10.0.0.1/8'"),
        ("BENCHMARK_ALLOWED_HOSTS", "http://lab", "BENCHMARK_ALLOWED_HOSTS: 'http://lab'"),
        ("ACTUATOR_SECRET_ENV_NAMES", "mu lower", "ACTUATOR_SECRET_ENV_NAMES: 'mu lower'"),
        ("ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS", "sure", "ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS='sure'"),
        ("KUBERNETES_CLUSTERS", '{"prod": {}}', "KUBERNETES_CLUSTERS: profile 'prod' needs"),
        (
            "KUBERNETES_CLUSTERS",
            '{"lab": {"api_server": "https://10.0.0.1:6443", "token_env": "SECRET_KEY"}}',
            "control plane's own secrets",
        ),
        ("ACTUATOR_SECRET_DESTINATIONS", "{nope", "ACTUATOR_SECRET_DESTINATIONS: is not JSON"),
        (
            "ACTUATOR_SECRET_DESTINATIONS",
            '{"MU_ACTUATOR_T": {"supervisor": ["gpu-07"]}}',
            "ACTUATOR_SECRET_DESTINATIONS: MU_ACTUATOR_T: 'gpu-07' needs a port",
        ),
        (
            "ACTUATOR_SECRET_DESTINATIONS",
            '{"MU_ACTUATOR_T": {"supervisor": ["gpu-07:8190"], "webhook": ["hooks:443"]}}',
            "one kind of destination per secret",
        ),
        (
            "ACTUATOR_SECRET_DESTINATIONS",
            '{"SECRET_KEY": {"webhook": ["https://hooks.example"]}}',
            "control plane's own secrets",
        ),
        ("ACTUATOR_ALLOW_UNBOUND_SECRETS", "sure", "ACTUATOR_ALLOW_UNBOUND_SECRETS='sure'"),
        ("API_THROTTLE_WRITES", "lots", "API_THROTTLE_WRITES='lots' is not a rate"),
        ("API_THROTTLE_WRITES", "²/min", "API_THROTTLE_WRITES='²/min' is not a rate"),
        ("TRUSTED_PROXY_COUNT", "-1", "TRUSTED_PROXY_COUNT=-1 must be at least 0"),
        ("LOGIN_USERNAME_FAILURE_LIMIT", "3", "LOGIN_USERNAME_FAILURE_LIMIT=3 must be at least 5"),
        ("METRICS_TOKEN", "prometheus", "METRICS_TOKEN is shorter than 32 characters"),
        ("API_THROTTLE_READS", "many", "API_THROTTLE_READS='many' is not a rate"),
        ("PUBLICATION_SIGNING_KEY", "k1:tooshort", "PUBLICATION_SIGNING_KEY: key 'k1' is not"),
        (
            "PUBLICATION_SIGNING_KEY",
            "",
            "PUBLICATION_SIGNING_KEY is required when DEBUG is off",
        ),
        ("API_THROTTLE_EXPORTS", "10/fortnight", "API_THROTTLE_EXPORTS='10/fortnight'"),
        (
            "COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS",
            "lots",
            "COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS='lots' is not an integer",
        ),
        (
            "COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS",
            "0",
            "COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS=0 must be at least 1",
        ),
    ],
)
def test_a_malformed_value_stops_start_up_naming_the_variable(variable, value, says):
    result = run_manage("check", **(PRODUCTION_LIKE | {variable: value}))
    assert result.returncode != 0
    assert says in result.stderr


def test_a_cluster_token_bound_to_a_supervisor_as_well_stops_start_up():
    cluster = '{"lab": {"api_server": "https://10.0.0.1:6443", "token_env": "MU_ACTUATOR_K8S"}}'
    env = PRODUCTION_LIKE | {"KUBERNETES_CLUSTERS": cluster}

    refused = run_manage(
        "check",
        **env,
        ACTUATOR_SECRET_DESTINATIONS='{"MU_ACTUATOR_K8S": {"supervisor": ["10.0.0.9:8190"]}}',
    )
    started = run_manage(
        "check",
        **env,
        ACTUATOR_SECRET_DESTINATIONS='{"MU_ACTUATOR_GPU07": {"supervisor": ["10.0.0.9:8190"]}}',
    )

    assert refused.returncode != 0
    assert (
        "ACTUATOR_SECRET_DESTINATIONS: MU_ACTUATOR_K8S is the token of cluster profile 'lab'"
        in refused.stderr
    )
    assert started.returncode == 0, started.stderr


def test_a_missing_secret_key_stops_start_up_unless_debug():
    env = dict(PRODUCTION_LIKE)
    del env["SECRET_KEY"]
    result = run_manage("check", **env)
    assert result.returncode != 0
    assert "SECRET_KEY is required when DEBUG is off" in result.stderr

    assert run_manage("check", **(env | {"DEBUG": "1"})).returncode == 0


@pytest.mark.parametrize(
    "secret",
    [
        "build-only",
        "changeme",
        "secret",
        "controlplane",
        "django-insecure-" + "k" * 40 + "abcdef",
        "short-but-random-7Hq2",
        "a" * 60,
        # Long enough, with Django's own floor of 5 distinct characters (issue 34).
        "abcde" * 10,
        # Ten distinct characters or more, but one short run repeated: a keyboard row, a count.
        "qwertyuiop" * 5,
        "0123456789ab" * 4 + "01234",
    ],
)
def test_start_up_refuses_placeholder_secrets_unless_debug(secret):
    result = run_manage("check", **(PRODUCTION_LIKE | {"SECRET_KEY": secret}))
    assert result.returncode != 0
    assert "SECRET_KEY is a placeholder or too weak" in result.stderr
    assert f"'{secret}'" not in result.stderr  # the message never repeats the secret


def test_start_up_accepts_the_keys_the_usual_generators_make():
    """token_urlsafe (what the docs say), Django's own generator, and hex keys (`openssl rand
    -hex 32`: 16 symbols at most, the reason the distinct-character floor is 10, not more)."""
    from django.core.management.utils import get_random_secret_key

    for secret in (secrets.token_urlsafe(50), get_random_secret_key(), secrets.token_hex(25)):
        result = run_manage("check", **(PRODUCTION_LIKE | {"SECRET_KEY": secret}))
        assert result.returncode == 0, result.stderr


def test_a_debug_process_may_run_with_a_placeholder_secret():
    env = PRODUCTION_LIKE | {"SECRET_KEY": "changeme", "DEBUG": "1"}
    assert run_manage("check", **env).returncode == 0


def test_the_build_step_flag_exempts_collectstatic_and_nothing_else(tmp_path):
    env = dict(PRODUCTION_LIKE)
    del env["SECRET_KEY"]
    build = env | {"CONTROLPLANE_BUILD_STEP": "collectstatic", "STATIC_ROOT": str(tmp_path)}
    # Only the planner's own files: WhiteNoise compresses whatever is collected, and the
    # vendored admin, DRF and API-docs assets would make this half a minute of CPU.
    skip_vendored = ("-i", "admin", "-i", "rest_framework", "-i", "drf_spectacular_sidecar")
    collected = run_manage(
        "collectstatic", "--noinput", "--verbosity", "0", *skip_vendored, **build
    )
    assert collected.returncode == 0, collected.stderr
    assert (tmp_path / "planner" / "planner.css").exists()

    refused = run_manage("check", **build)
    assert refused.returncode != 0
    assert "CONTROLPLANE_BUILD_STEP='collectstatic' is only for" in refused.stderr


def test_check_deploy_passes_with_production_like_settings():
    result = run_manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION_LIKE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_the_embedded_default_database_is_sqlite_in_wal_mode(tmp_path):
    code = (
        "import django; django.setup();"
        "from django.conf import settings; from django.db import connection;"
        "db = settings.DATABASES['default'];"
        "print(db['ENGINE'], db['NAME']);"
        "cursor = connection.cursor(); cursor.execute('PRAGMA journal_mode');"
        "print(cursor.fetchone()[0]);"
        "cursor.execute('PRAGMA busy_timeout'); print(cursor.fetchone()[0])"
    )
    environment = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    environment |= {"DEBUG": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    engine_line, journal_mode, busy_timeout_ms = result.stdout.split("\n")[:3]
    assert engine_line.startswith("django.db.backends.sqlite3 ")
    assert engine_line.endswith("var/controlplane.sqlite3")
    assert journal_mode == "wal"
    assert int(busy_timeout_ms) >= 5000


def test_https_behind_a_proxy_is_honoured(client, settings):
    settings.SECURE_SSL_REDIRECT = True
    plain = client.get("/healthz")
    assert plain.status_code == 200  # probes are exempt from the redirect

    redirected = client.get("/api/docs/")
    assert redirected.status_code == 301
    assert redirected["Location"].startswith("https://")

    forwarded = client.get("/api/docs/", HTTP_X_FORWARDED_PROTO="https")
    assert forwarded.status_code != 301
