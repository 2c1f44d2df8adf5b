"""Settings for every environment; only environment variables set them (docs/design.md#settings)."""

import os
import sys
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from core import outbound
from core.env import (
    env_bool,
    env_database,
    env_float,
    env_int,
    env_list,
    env_optional_int,
    env_origins,
    env_parsed,
    env_rate,
    env_redis_url,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

DEBUG = env_bool("DEBUG", False)

# The image build runs `collectstatic` with CONTROLPLANE_BUILD_STEP=collectstatic and no secret
# (deploy/Dockerfile); the flag exempts that one command from the secret checks below, nothing
# else.
BUILD_STEP = env_str("CONTROLPLANE_BUILD_STEP", "")
if BUILD_STEP and (BUILD_STEP != "collectstatic" or sys.argv[1:2] != ["collectstatic"]):
    raise ImproperlyConfigured(
        f"CONTROLPLANE_BUILD_STEP={BUILD_STEP!r} is only for the image build's "
        "`manage.py collectstatic`; unset it for anything else."
    )
_GENERATE_SECRET = "python -c 'import secrets; print(secrets.token_urlsafe(50))'"
# Values that have appeared in examples, compose files and builds: never a production secret.
KNOWN_PLACEHOLDER_SECRETS = frozenset(
    {"build-only", "changeme", "change-me", "secret", "secret-key", "controlplane", "django"}
)
# Django's own check asks for 5 distinct characters, which "abcde" * 10 meets. Ten refuses such
# short alphabets yet admits every generator an operator uses: token_urlsafe(50) and Django's
# get_random_secret_key() give 30-45 distinct characters, and hex keys (`openssl rand -hex 32`)
# at most 16, of which 50 random hex digits show fewer than 10 about once in 10^8.
SECRET_KEY_MIN_DISTINCT_CHARACTERS = 10


def _repeats_a_shorter_run(text: str) -> bool:
    """True for a key that is one run written over and over ("qwertyuiop" * 5, a counter):
    however many characters it has, it is worth no more than its run."""
    return any(text[period:] == text[:-period] for period in range(1, len(text) // 2 + 1))


SECRET_KEY = env_str("SECRET_KEY")
if BUILD_STEP:
    # Nothing is signed while static files are collected; this key exists only in that process.
    SECRET_KEY = "build-step-only-" + "x" * 50
elif not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is required when DEBUG is off. Set SECRET_KEY to a long random string "
            f"({_GENERATE_SECRET}) or set DEBUG=1."
        )
    # Only a DEBUG process may run without a secret; its sessions do not survive a restart.
    SECRET_KEY = "insecure-debug-only-" + "x" * 40
elif not DEBUG and (
    SECRET_KEY.lower() in KNOWN_PLACEHOLDER_SECRETS
    or SECRET_KEY.startswith("django-insecure")
    or len(SECRET_KEY) < 50
    or len(set(SECRET_KEY)) < SECRET_KEY_MIN_DISTINCT_CHARACTERS
    or _repeats_a_shorter_run(SECRET_KEY)
):
    raise ImproperlyConfigured(
        "SECRET_KEY is a placeholder or too weak (known example value, fewer than 50 "
        f"characters, fewer than {SECRET_KEY_MIN_DISTINCT_CHARACTERS} distinct ones, or one "
        "run repeated) and DEBUG is off. Set SECRET_KEY to a long random string "
        f"({_GENERATE_SECRET}) or set DEBUG=1."
    )

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_origins("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "axes",
    "csp",
    "core",
    "controlplane",
    "accounts",
    "capacity",
    "benchmarking",
    "billing",
    "simulation",
    "planner",
    "portal",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "core.middleware.RefuseControlCharacters",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Lets services name who made each change in the audit log (core.audit).
    "core.audit.AuditActorMiddleware",
    "csp.middleware.CSPMiddleware",
    # Last: it answers a locked-out login attempt (see "Login lockout" below).
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
# The embedded default is a SQLite file in WAL mode with a busy timeout, so that the web server,
# the Celery worker and beat started by `make run` can share it. Production and tests use
# PostgreSQL through DATABASE_URL.
_DEFAULT_SQLITE_URL = f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}"
_database = env_database("DATABASE_URL", _DEFAULT_SQLITE_URL)
if _database["ENGINE"] == "django.db.backends.sqlite3":
    # A fresh checkout has no var/ yet; SQLite creates the file but not its folder.
    Path(_database["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    _database["CONN_MAX_AGE"] = 0
    _database["CONN_HEALTH_CHECKS"] = False
    _database["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DATABASES = {"default": _database}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis and Celery -----------------------------------------------------------------------
REDIS_URL = env_redis_url("REDIS_URL", "redis://127.0.0.1:6379/0")

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The API reads rows, never the result backend (docs/design.md#tasks); results are not kept.
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 900, minimum=1)
CELERY_TASK_SOFT_TIME_LIMIT = env_int(
    "CELERY_TASK_SOFT_TIME_LIMIT", max(1, CELERY_TASK_TIME_LIMIT - 30), minimum=1
)
if CELERY_TASK_SOFT_TIME_LIMIT > CELERY_TASK_TIME_LIMIT:
    raise ImproperlyConfigured(
        "CELERY_TASK_SOFT_TIME_LIMIT must not exceed CELERY_TASK_TIME_LIMIT "
        f"({CELERY_TASK_SOFT_TIME_LIMIT} > {CELERY_TASK_TIME_LIMIT})."
    )
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_QUEUES = tuple(
    Queue(name, routing_key=name) for name in ("default", "allocation", "benchmarks", "health")
)
# Tasks queued by name (Celery's send_task), routed here rather than by their decorators: the
# what-if (simulation.tasks), under its name and under the one it had in the benchmarking app
# (messages queued before the rename), to the benchmarks queue: long, CPU-bound work nobody
# waits on by the second, kept off "default" (short periodic housekeeping whose messages expire
# within seconds) and "allocation" (the control loop's tick).
CELERY_TASK_ROUTES = {
    "simulation.run_whatif": {"queue": "benchmarks"},
    "benchmarking.run_whatif": {"queue": "benchmarks"},
}
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"

# --- Auth, i18n, static ---------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Planners (the planner UI) and customers' owners and members (the portal) log in here; the
# admin keeps its own login page.
LOGIN_URL = "login"
# Password logins (the planner's /login/ and the admin's) go through django-axes first, which
# refuses a (username, client address) pair after too many failures. API keys do not pass
# through Django's backends (accounts.authentication), so lockout never touches them.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Planners and customers' users log in at the same page; the portal's home sends each where
# it belongs (planners to the planner UI, a customer's users to their customer's pages).
LOGIN_REDIRECT_URL = "portal:home"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "static")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "django.contrib.staticfiles.storage.StaticFilesStorage"
            if DEBUG
            # Compressed, without a manifest: a process that has not run collectstatic
            # (tests, one-off commands) still renders pages.
            else "whitenoise.storage.CompressedStaticFilesStorage"
        )
    },
}

# --- HTTPS behind a proxy -------------------------------------------------------------------
# The proxy in front of the control plane terminates TLS and must set X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Probes from the orchestrator speak plain HTTP to the pod.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# --- REST API -------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.BearerApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "core.api.pagination.StandardPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "core.api.filters.BoundedFilterBackend",
        "rest_framework.filters.OrderingFilter",
        "rest_framework.filters.SearchFilter",
    ],
    # DRF's parsers, with the JSON one refusing bodies nested deeper than API_MAX_JSON_DEPTH.
    "DEFAULT_PARSER_CLASSES": [
        "core.api.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.api.errors.api_exception_handler",
    # Writes and reads per key (or user), exports beside reads; usage ingestion has its own
    # limit (API_THROTTLE_* below).
    "DEFAULT_THROTTLE_CLASSES": [
        "accounts.throttling.WriteThrottle",
        "accounts.throttling.ReadThrottle",
        "accounts.throttling.ExportThrottle",
    ],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Model-Unit Control Plane API",
    "DESCRIPTION": (
        "Capacity, reservations, metering, allocation and billing for LLM inference fleets, "
        "in model units (MU). Authenticate with `Authorization: Bearer <prefix.secret>`."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from this server's static files (drf-spectacular-sidecar), never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "accounts.throttling.document_throttled_responses",
        "core.api.schema.document_error_responses",
    ],
    "COMPONENT_SPLIT_REQUEST": True,
    "SECURITY": [{"BearerApiKey": []}],
    # Several models have a `status` field with their own choices: name each enum after its model.
    "ENUM_NAME_OVERRIDES": {
        "CostModelStatusEnum": "capacity.models.cost_models.CostModel.Status",
        "ReservationStatusEnum": "capacity.models.reservations.Reservation.Status",
        "BenchmarkRunStatusEnum": "benchmarking.models.BenchmarkRun.Status",
        "InvoiceStatusEnum": "billing.models.Invoice.Status",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # One line per HTTP request of the load runner would drown everything else.
    "loggers": {"httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"}},
}

# --- Cost models and benchmarks ---------------------------------------------------------------
# A fit whose cross-validated MAPE is at most this activates by itself (docs/design.md#versions).
COST_MODEL_MAX_ACTIVE_MAPE = env_int("COST_MODEL_MAX_ACTIVE_MAPE_PERCENT", 10, minimum=0) / 100
# ... and only when, priced on the last 7 days of real request shapes, it changes the total, and
# each customer's charge, by at most this share, from the active version and from the last one
# a planner approved or the one in force 30 days ago (whichever is more recent); a larger change
# waits for a planner, so prices never drift, night to night or step by step, without review
# (capacity.pricing.review).
COST_MODEL_MAX_AUTO_CHANGE = env_float("COST_MODEL_MAX_AUTO_CHANGE_PERCENT", 5.0, minimum=0) / 100
# The per-customer limit counts the customers with at least this many requests in those 7 days:
# one who sent a handful of odd requests would otherwise hold every fit, for a bill that moves
# by little. 100 a week is a customer in real use (about 14 a day).
COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = env_int(
    "COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS", 100, minimum=1
)
# A run whose client adds more than this share to the TTFT the engines measure is unreliable:
# it measures itself, and is never fitted (issue 21).
BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT = env_int(
    "BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT", 10, minimum=1
)
# Client processes the load runner drives a point of 128 streams or more with (one event loop
# is the client's own limit at hundreds of streams): by default one per core, at most 8.
BENCHMARK_CLIENT_PROCESSES = env_int(
    "BENCHMARK_CLIENT_PROCESSES", min(os.cpu_count() or 1, 8), minimum=1
)
# How long an isolated run waits for its held replicas to serve, beyond the cold start.
BENCHMARK_REPLICA_WAIT_SECONDS = env_int("BENCHMARK_REPLICA_WAIT_SECONDS", 120, minimum=10)
# A running benchmark whose worker has not reported for this long is failed by the reaper.
BENCHMARK_STALE_AFTER_SECONDS = env_int("BENCHMARK_STALE_AFTER_SECONDS", 180, minimum=10)
BENCHMARK_TASK_TIME_LIMIT_SECONDS = env_int(
    "BENCHMARK_TASK_TIME_LIMIT_SECONDS", 4 * 3600, minimum=60
)

# --- Load metrics ----------------------------------------------------------------------------
# Prometheus scraping the engines (vLLM metrics). Empty: deployment load is unknown.
PROMETHEUS_URL = env_str("PROMETHEUS_URL", "")
PROMETHEUS_TIMEOUT_SECONDS = env_int("PROMETHEUS_TIMEOUT_SECONDS", 5, minimum=1)

# A batch of 5,000 usage events is about 2 MB of JSON; anything far larger is refused with 413
# before it is parsed.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("API_MAX_BODY_BYTES", 16 * 1024 * 1024, minimum=1024)
# JSON bodies nested deeper than this are refused with 400 before they are parsed (the deepest
# legitimate body nests 3 levels; Python's json would recurse into a RecursionError).
API_MAX_JSON_DEPTH = env_int("API_MAX_JSON_DEPTH", 32, minimum=4)

# --- Usage metering ----------------------------------------------------------------------------
# Events finished longer ago than this are refused (late billing data needs a planner).
USAGE_LATENESS_WINDOW_HOURS = env_int("USAGE_LATENESS_WINDOW_HOURS", 72, minimum=1)
# An admitted request whose usage event never came is closed by the reaper
# (capacity/metering/reaper.py) as cancelled at 0 MU once its gateway worker has not been seen
# alive for this long (a request sent through POST /api/v1/admission, with no worker behind
# it, once the lateness window is over).
USAGE_REAP_GRACE_SECONDS = env_int("USAGE_REAP_GRACE_SECONDS", 600, minimum=5)
# Clocks drift: an event may finish this far in the future.
USAGE_MAX_FUTURE_SECONDS = env_int("USAGE_MAX_FUTURE_SECONDS", 300, minimum=0)
# A usage event's request ran at most this long (started_at ≥ finished_at − this).
USAGE_MAX_DURATION_HOURS = env_int("USAGE_MAX_DURATION_HOURS", 24, minimum=1)

# --- Reservations (capacity/selling/reservations.py) ----------------------------------------------
# A sale ends at most this many days after it starts (or is open-ended).
RESERVATION_MAX_TERM_DAYS = env_int("RESERVATION_MAX_TERM_DAYS", 3650, minimum=1)
# A sale starts at most this many days from now, in the future or (backdated) in the past.
RESERVATION_START_WINDOW_DAYS = env_int("RESERVATION_START_WINDOW_DAYS", 365, minimum=1)

# --- Allocation ----------------------------------------------------------------------------------
ALLOCATION_TICK_SECONDS = env_int("ALLOCATION_TICK_SECONDS", 15, minimum=1)
# Scale down only to the highest recommendation of this many seconds (docs/design.md#the-tick).
ALLOCATION_STABILISATION_SECONDS = env_int("ALLOCATION_STABILISATION_SECONDS", 120, minimum=0)
# Each actuator push (with its retries) must answer within this; one that does not is recorded
# as a failure on its decision and abandoned (its HTTP timeout is capped below it), so one
# hanging data plane never holds the tick, and its lock, for longer.
ALLOCATION_PUSH_DEADLINE_SECONDS = env_float("ALLOCATION_PUSH_DEADLINE_SECONDS", 10.0, minimum=0.5)
# The fleet page charts 7 days; a day more keeps the oldest bucket whole.
CAPACITY_HISTORY_DAYS = env_int("CAPACITY_HISTORY_DAYS", 8, minimum=1)
# --- Health probes (capacity/health/probes.py) ----------------------------------------------------
HEALTH_PROBE_INTERVAL_SECONDS = env_int("HEALTH_PROBE_INTERVAL_SECONDS", 5, minimum=1)
HEALTH_PROBE_TIMEOUT_SECONDS = env_float("HEALTH_PROBE_TIMEOUT_SECONDS", 5.0, minimum=0.1)
HEALTH_PROBE_FAILURES = env_int("HEALTH_PROBE_FAILURES", 3, minimum=1)
HEALTH_PROBE_QUIET_SECONDS = env_int("HEALTH_PROBE_QUIET_SECONDS", 30, minimum=0)
HEALTH_PROBE_MAX_SKIP_SECONDS = env_int("HEALTH_PROBE_MAX_SKIP_SECONDS", 60, minimum=0)
# vLLM runs lower priority values first (--scheduling-policy priority); admission uses 0 and 1.
HEALTH_PROBE_PRIORITY = env_optional_int("HEALTH_PROBE_PRIORITY", -1)
HEALTH_PROBE_HISTORY_HOURS = env_int("HEALTH_PROBE_HISTORY_HOURS", 24, minimum=1)
HEALTH_RESTART_RETRY_SECONDS = env_int("HEALTH_RESTART_RETRY_SECONDS", 120, minimum=1)
HEALTH_UNLISTED_GONE_SECONDS = env_int("HEALTH_UNLISTED_GONE_SECONDS", 600, minimum=1)
# A pod drained for a scale-down but still ready this long after the last drain of its
# deployment, with the scale-down done, was kept by the platform: it serves again
# (capacity/actuation/drain.py). Longer than a push (ALLOCATION_PUSH_DEADLINE_SECONDS) and an
# HPA's sync (15 s), which stand between the drain and the pods' deletion.
HEALTH_DRAIN_SETTLE_SECONDS = env_int("HEALTH_DRAIN_SETTLE_SECONDS", 60, minimum=1)
# --- Publication to gateways (capacity/publication/, docs/gateway-contract.md) ----------------
# Bytes of request text per input token a gateway assumes before the engine counts them, until
# a per-model calibration exists (published per model as bytes_per_token).
PUBLICATION_BYTES_PER_TOKEN = env_float("PUBLICATION_BYTES_PER_TOKEN", 4.0, minimum=0.5)
# The calibration (capacity/metering/calibration.py): a model's own ratio over the usage of the
# last WINDOW hours, once its engines counted at least MIN_TOKENS input tokens in that window.
PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS = env_int(
    "PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS", 6, minimum=1
)
PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS = env_int(
    "PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS", 10_000, minimum=1
)
# Revoked (and expired) keys stay published this long with revoked: true (or their
# expires_at), so a gateway refuses them even if it missed the publication that revoked them.
PUBLICATION_REVOKED_KEYS_SECONDS = env_int("PUBLICATION_REVOKED_KEYS_SECONDS", 86400, minimum=60)
# The Ed25519 key publications are signed with, "<id>:<base64 private key>"
# (`manage.py publication_keys new` makes one; docs/gateway-contract.md, "Signed
# publications"). Gateways given the public half refuse any publication it did not sign, so
# Redis write access is no way to forge a key. Empty: unsigned, development only: with DEBUG
# off the capacity app refuses to start without it (capacity/apps.py).
PUBLICATION_SIGNING_KEY = env_str("PUBLICATION_SIGNING_KEY", "")
# --- Admission (capacity/admission/gate.py) -------------------------------------------------------
ADMISSION_REDIS_URL = env_redis_url("ADMISSION_REDIS_URL", REDIS_URL)
# Burst tolerance of every bucket, in seconds of its rate.
ADMISSION_BURST_SECONDS = env_int("ADMISSION_BURST_SECONDS", 10, minimum=1)
# A decision waits this long for Redis before the fallback answers.
ADMISSION_REDIS_TIMEOUT_MS = env_int("ADMISSION_REDIS_TIMEOUT_MS", 250, minimum=1)
# Redis unreachable: guaranteed (admit up to the reservation from a local bucket, refuse
# best-effort) or none (refuse everything). There is no "admit everything": a fallback with no
# bucket, no limit and no budget would admit the unbounded while the store is down.
ADMISSION_ON_REDIS_DOWN = env_str("ADMISSION_ON_REDIS_DOWN", "guaranteed")
if ADMISSION_ON_REDIS_DOWN not in {"guaranteed", "none"}:
    raise ImproperlyConfigured(
        f"ADMISSION_ON_REDIS_DOWN must be guaranteed or none, not {ADMISSION_ON_REDIS_DOWN!r}"
        + (
            " (all, which admitted without bound while Redis was down, was removed; "
            "guaranteed admits each reservation from a bucket in every process)"
            if ADMISSION_ON_REDIS_DOWN == "all"
            else ""
        )
    )
# The "guaranteed" fallback's bucket lives in each process (a gunicorn worker, a gateway), so N
# processes admit up to N × a reservation while Redis is down. Each process's bucket gets
# 1/ADMISSION_FALLBACK_PROCESSES of the reservation's rate and burst: set it to the number of
# processes that answer admission (all web workers on all hosts, plus in-process gateways), and
# the fleet admits at most the reservation. Too high only refuses more during the outage.
ADMISSION_FALLBACK_PROCESSES = env_int("ADMISSION_FALLBACK_PROCESSES", 1, minimum=1)
# The estimate caps max_tokens at this percentile of the model's recent output lengths.
ADMISSION_OUTPUT_PERCENTILE = env_int("ADMISSION_OUTPUT_PERCENTILE", 95, minimum=1)
# Limits the ticks stop refreshing, and idle buckets, vanish after this long (reservation
# floors do not: they last as long as what was sold, capacity/admission/floors.py).
ADMISSION_LIMITS_TTL_SECONDS = env_int("ADMISSION_LIMITS_TTL_SECONDS", 600, minimum=30)
# A tick older than this is stale: /readyz says "degraded", the planner's pages and the alert
# webhook say so, and the best-effort allowances start losing their worth; they are worth
# nothing at ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS. Reservation floors never age.
ADMISSION_TICK_STALE_SECONDS = env_int(
    "ADMISSION_TICK_STALE_SECONDS", 4 * ALLOCATION_TICK_SECONDS, minimum=1
)
ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS = env_int(
    "ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS", 3 * ADMISSION_TICK_STALE_SECONDS, minimum=2
)
if ADMISSION_TICK_STALE_SECONDS <= ALLOCATION_TICK_SECONDS:
    raise ImproperlyConfigured(
        f"ADMISSION_TICK_STALE_SECONDS={ADMISSION_TICK_STALE_SECONDS} must exceed "
        f"ALLOCATION_TICK_SECONDS={ALLOCATION_TICK_SECONDS}: every tick would be stale."
    )
if ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS <= ADMISSION_TICK_STALE_SECONDS:
    raise ImproperlyConfigured(
        "ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS="
        f"{ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS} must exceed "
        f"ADMISSION_TICK_STALE_SECONDS={ADMISSION_TICK_STALE_SECONDS}."
    )
# A request holds a concurrency slot (capacity.admission.limits) until its gateway's end of
# request or its usage event frees it; one never freed (a gateway died) lapses after this long,
# and so does a request still running then (it stops counting against the limit).
ADMISSION_CONCURRENCY_TTL_SECONDS = env_int("ADMISSION_CONCURRENCY_TTL_SECONDS", 600, minimum=1)
# How long admission records (admitted and refused) are kept: each decides its usage event's
# class, so it must outlive the usage lateness window (the default adds an hour of margin).
ADMISSION_RECORD_TTL_SECONDS = env_int(
    "ADMISSION_RECORD_TTL_SECONDS", USAGE_LATENESS_WINDOW_HOURS * 3600 + 3600, minimum=60
)
if ADMISSION_RECORD_TTL_SECONDS < USAGE_LATENESS_WINDOW_HOURS * 3600:
    raise ImproperlyConfigured(
        f"ADMISSION_RECORD_TTL_SECONDS={ADMISSION_RECORD_TTL_SECONDS} is shorter than the usage "
        f"lateness window ({USAGE_LATENESS_WINDOW_HOURS} h): late usage events would find no "
        "admission record and be billed as best-effort."
    )

# --- Billing ------------------------------------------------------------------------------------
BILLING_CURRENCY = env_str("BILLING_CURRENCY", "USD")
# An SLA credit is this share of the commitment of each minute a guaranteed request was
# refused while the customer used less than its reservation.
BILLING_SLA_CREDIT_SHARE = float(env_str("BILLING_SLA_CREDIT_SHARE", "0.5"))

# The TTFT the fleet is sized to keep under sub-minute bursts (capacity.allocation.bursts).
ALLOCATION_TTFT_SLO_MS = env_int("ALLOCATION_TTFT_SLO_MS", 2000, minimum=1)
# The share of requests that objective is for (capacity.allocation.slo corrects the capacity a
# replica is counted at by how much of the error budget the last half hour burnt).
ALLOCATION_SLO_TARGET = env_float("ALLOCATION_SLO_TARGET", 0.99, minimum=0.5)
if ALLOCATION_SLO_TARGET >= 1:
    raise ImproperlyConfigured(
        f"ALLOCATION_SLO_TARGET must be below 1 (a share of requests), got {ALLOCATION_SLO_TARGET}"
    )

# --- Trust boundaries: what the control plane may reach, and with which secrets ------------------
# Operator settings, never API fields (docs/design.md#trust); core/outbound.py applies them.


def _host_list(name: str, default: tuple[str, ...] | list[str]) -> list[str]:
    def parse(text: str) -> list[str]:
        entries = [item.strip() for item in text.split(",") if item.strip()]
        outbound.HostPolicy.parse(name, entries)  # raises ValueError naming the bad entry
        return entries

    return env_parsed(name, list(default), parse)


# Where actuators, health probes and restarts may connect (CIDRs, addresses, host names).
OUTBOUND_ALLOWED_HOSTS = _host_list("OUTBOUND_ALLOWED_HOSTS", outbound.DEFAULT_ALLOWED_HOSTS)
# Where benchmark runs may send load.
BENCHMARK_ALLOWED_HOSTS = _host_list("BENCHMARK_ALLOWED_HOSTS", OUTBOUND_ALLOWED_HOSTS)
# Environment variables an actuator config may name in token_env / secret_env.
ACTUATOR_SECRET_ENV_NAMES = list(
    env_parsed(
        "ACTUATOR_SECRET_ENV_NAMES",
        outbound.DEFAULT_SECRET_ENV_NAMES,
        lambda text: outbound.parse_secret_env_patterns(text.split(",")),
    )
)
# A webhook actuator without a signing secret is refused unless this is on.
ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS = env_bool("ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS", False)
# Where alerts of sold capacity at risk go (capacity.selling.at_risk): one signed POST each
# time a model becomes oversold or short of guaranteed capacity, and when it recovers. Empty:
# none is sent (the state is still recorded, shown and on /metrics). The URL must be allowed
# by OUTBOUND_ALLOWED_HOSTS; the secret signs as the webhook actuator does.
ALERT_WEBHOOK_URL = env_str("ALERT_WEBHOOK_URL", "")
ALERT_WEBHOOK_SECRET = env_str("ALERT_WEBHOOK_SECRET", "")
if ALERT_WEBHOOK_URL and not ALERT_WEBHOOK_SECRET:
    raise ImproperlyConfigured("ALERT_WEBHOOK_URL needs ALERT_WEBHOOK_SECRET to sign alerts.")
ALERT_WEBHOOK_ATTEMPTS = env_int("ALERT_WEBHOOK_ATTEMPTS", 3, minimum=1)
ALERT_WEBHOOK_TIMEOUT_SECONDS = env_int("ALERT_WEBHOOK_TIMEOUT_SECONDS", 5, minimum=1)
# Mail (budget and under-use alerts, billing.budgets), through Django's SMTP backend: the
# server and its credentials are operator settings, never API fields.
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT_SECONDS", 10, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "control-plane@localhost")
# Named Kubernetes clusters an actuator config picks with `cluster`.
KUBERNETES_CLUSTERS = env_parsed(
    "KUBERNETES_CLUSTERS",
    outbound.DEFAULT_KUBERNETES_CLUSTERS,
    lambda text: outbound.parse_kubernetes_clusters(
        text, secret_env_patterns=ACTUATOR_SECRET_ENV_NAMES
    ),
)
# Where each actuator secret may be sent (issue 34): JSON {NAME: {"supervisor" | "webhook":
# [destination, ...]}}, a destination "scheme://host:port" or "host:port". A cluster profile's
# token_env is bound to that profile already. A name bound nowhere is sent nowhere unless
# ACTUATOR_ALLOW_UNBOUND_SECRETS is on (the behaviour before bindings: any allowed host).
ACTUATOR_SECRET_DESTINATIONS = env_parsed(
    "ACTUATOR_SECRET_DESTINATIONS",
    {},
    lambda text: outbound.parse_secret_destinations(
        text,
        kubernetes_clusters=KUBERNETES_CLUSTERS,
        secret_env_patterns=ACTUATOR_SECRET_ENV_NAMES,
    ),
)
ACTUATOR_ALLOW_UNBOUND_SECRETS = env_bool("ACTUATOR_ALLOW_UNBOUND_SECRETS", False)

# --- Cache (Redis) ------------------------------------------------------------------------------
# Shared by every process, so that API throttles hold across gunicorn workers and hosts.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": env_redis_url("CACHE_REDIS_URL", REDIS_URL),
        "KEY_PREFIX": "cp-cache",
        "TIMEOUT": 300,
    }
}

# --- Client address behind proxies -------------------------------------------------------------
# How many reverse proxies in front of the control plane append to X-Forwarded-For. 0: the
# client is REMOTE_ADDR and X-Forwarded-For is ignored (anyone can write it). N: the client is
# the address the outermost trusted proxy saw, N entries from the right of the chain
# (core/client_ip.py). Too low, and every login seems to come from the proxy. Too high,
# or a port that lets clients past the proxy (deploy/compose.yaml binds web to 127.0.0.1 for
# this), and a client writes its own address; the username's lockout below still holds then.
TRUSTED_PROXY_COUNT = env_int("TRUSTED_PROXY_COUNT", 0, minimum=0)

# --- /metrics (core/metrics_view.py) -----------------------------------------------------
# Set: /metrics answers only `Authorization: Bearer <METRICS_TOKEN>` (Prometheus's scrape
# config passes it from a Secret), from anywhere. Empty: only the host itself (a loopback client
# address, as TRUSTED_PROXY_COUNT reads it). Never anyone else: the metrics name the fleet's
# deployments and models, its load and what is oversold. The production Ingress does not route
# /metrics at all.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
METRICS_TOKEN_MIN_CHARACTERS = 32
if METRICS_TOKEN and len(METRICS_TOKEN) < METRICS_TOKEN_MIN_CHARACTERS:
    raise ImproperlyConfigured(
        f"METRICS_TOKEN is shorter than {METRICS_TOKEN_MIN_CHARACTERS} characters: use "
        "python -c 'import secrets; print(secrets.token_urlsafe(32))', or leave it empty to "
        "serve /metrics to the host itself only."
    )

# --- Login lockout (django-axes) ----------------------------------------------------------------
# After LOGIN_FAILURE_LIMIT wrong passwords for one username from one client address, that pair
# is refused (429, a page that says so) for LOGIN_COOLOFF_SECONDS, even with the right password;
# the same user from elsewhere, and other users from that address, still log in. After
# LOGIN_USERNAME_FAILURE_LIMIT wrong passwords for one username from any addresses, that
# username is refused from everywhere for as long: guesses that each show a new address (a
# forged X-Forwarded-For, many machines) never go on without end (core/lockout.py).
# The price is that anyone can lock a username out for a cool-off; `manage.py
# axes_reset_username NAME` lifts it.
AXES_ENABLED = True
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
LOGIN_USERNAME_FAILURE_LIMIT = env_int(
    "LOGIN_USERNAME_FAILURE_LIMIT", 2 * AXES_FAILURE_LIMIT, minimum=AXES_FAILURE_LIMIT
)
AXES_COOLOFF_TIME = timedelta(seconds=env_int("LOGIN_COOLOFF_SECONDS", 900, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"], "username"]
AXES_HANDLER = "core.lockout.UsernameAndAddressLockoutHandler"
AXES_CLIENT_IP_CALLABLE = "core.client_ip.client_ip"
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_HTTP_RESPONSE_CODE = 429

# --- API throttles ----------------------------------------------------------------------------
# Per API key (or signed-in user; an anonymous reader of the schema per client address), in
# Redis (CACHES): "N/s", "N/min", "N/hour", "N/day"; "none" (or empty) turns a limit off. A
# throttled request gets 429 with Retry-After (accounts/throttling.py).
# Writes: every POST/PUT/PATCH/DELETE except admission decisions and usage ingestion.
API_THROTTLE_WRITES = env_rate("API_THROTTLE_WRITES", "600/min")
# Reads: every GET (and HEAD, OPTIONS). A hundred a second per key is more than any client or
# dashboard reads; it stops one key (a leaked one, a runaway script) from taking the workers.
API_THROTTLE_READS = env_rate("API_THROTTLE_READS", "6000/min")
# Exports, counted besides reads: the reads that build a whole document per request, an
# invoice's PDF (most of a second of CPU) or CSV, the usage CSV (every matching event), the API
# schema (about 1 MB), and the portal's invoice downloads. 30 a minute lets a platform key fetch
# a month's invoices of 500 customers in 17 minutes while one caller holds at most a third of
# one worker.
API_THROTTLE_EXPORTS = env_rate("API_THROTTLE_EXPORTS", "30/min")
# Usage ingestion: batches posted to /api/v1/usage/events (each up to 5,000 events). Every
# gateway worker posts about one a second under its key, all of a fleet's gateways usually
# under one service key, and a throttled batch is spooled and delivered late (demand,
# readiness of idle reservations and bursts then lag behind): 20 a second per key.
API_THROTTLE_USAGE = env_rate("API_THROTTLE_USAGE", "1200/min")

# --- Content Security Policy (django-csp) -------------------------------------------------------
# Scripts only from this server's static files: the planner's vendored htmx and Chart.js, the
# admin's, Swagger UI's (drf-spectacular-sidecar, its init script served by the docs view).
# Inline style attributes stay allowed (the planner's templates and Swagger UI use them); they
# cannot run code.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "frame-ancestors": ["'none'"],
        "form-action": ["'self'"],
    }
}
