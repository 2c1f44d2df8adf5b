"""Who may call what: every API endpoint × every kind of caller, generated from the URL conf
(issue 16). An endpoint the table does not list fails the test, so a new endpoint must say who
may call it.

Each cell is what a caller gets: `ok` (the call went through the permission checks: a 2xx, or
a 400/409/429 about the body or the state), 401 (not signed in), 403 (signed in, not allowed)
or 404 (another tenant's object, hidden as if it did not exist). Objects belong to acme; the
outsider is globex's owner; customer keys are acme's; service keys are platform keys. Writes
send an empty JSON body and every request is rolled back, so no call changes what the next
one sees.

Set MATRIX_DUMP=1 to print the observed table in this file's format.
"""

import os
import re
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import transaction
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from accounts import scopes as S
from accounts.services import api_key_create
from benchmarking.models import BenchmarkRun
from benchmarking.services import suite_create
from billing.generation import invoice_generate
from billing.models import Budget, Invoice
from billing.rates import rate_card_create
from capacity.health.services import degradation_policy_save
from capacity.models import AllocationDecision, CostModel, RequestLimit, Reservation
from tests.conftest import make_cost_model

pytestmark = [pytest.mark.django_db, pytest.mark.slow(seconds=40)]

CALLERS = (
    "anon",
    "owner",
    "member",
    "outsider",
    "c:read",
    "c:write",
    "c:usage",
    "c:adm",
    "s:read",
    "s:write",
    "s:usage",
    "s:adm",
    "s:resv",
    "s:cat",
    "s:cust",
    "planner",
)
CUSTOMER_KEY_SCOPES = {"c:read": S.READ, "c:write": S.WRITE, "c:usage": S.USAGE_WRITE,
                       "c:adm": S.ADMISSION}  # fmt: skip
SERVICE_KEY_SCOPES = {
    "s:read": S.READ,
    "s:write": S.WRITE,
    "s:usage": S.USAGE_WRITE,
    "s:adm": S.ADMISSION,
    "s:resv": S.RESERVATIONS_WRITE,
    "s:cat": S.CATALOG_WRITE,
    "s:cust": S.CUSTOMERS_WRITE,
}

# Who may do what. Columns follow CALLERS.
EXPECTED_TABLE = """
#                                                        | anon owner member outsider c:read c:write c:usage c:adm s:read s:write s:usage s:adm s:resv s:cat s:cust planner
GET /api/v1/me                                           | 401  ok    ok     ok       ok     ok      ok      ok    ok     ok      ok      ok    ok     ok    ok     ok
GET /api/v1/customers/                                   | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/customers/                                  | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
DELETE /api/v1/customers/{slug}/                         | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   404    ok
GET /api/v1/customers/{slug}/                            | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/customers/{slug}/                          | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   404    ok
PUT /api/v1/customers/{slug}/                            | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   404    ok
GET /api/v1/api-keys/                                    | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/api-keys/                                   | 401  ok    403    ok       403    ok      403     403   403    403     403     403   403    403   ok     ok
GET /api/v1/api-keys/{pk}/                               | 401  ok    ok     404      ok     403     403     403   404    403     403     403   403    403   403    ok
POST /api/v1/api-keys/{pk}/revoke/                       | 401  ok    403    404      403    ok      403     403   404    404     404     404   404    404   ok     ok
GET /api/v1/tiers/                                       | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/tiers/                                      | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
DELETE /api/v1/tiers/{name}/                             | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
GET /api/v1/tiers/{name}/                                | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/tiers/{name}/                              | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
POST /api/v1/cost-models/estimate                        | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/usage/events                                 | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/usage/events                                | 401  403   403    403      403    403     ok      403   403    403     ok      403   403    403   403    ok
GET /api/v1/usage/events/csv                             | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/admission                                   | 401  403   403    403      403    403     403     ok    403    403     403     ok    403    403   403    ok
POST /api/v1/allocation/wake                             | 401  403   403    403      403    403     403     403   403    403     ok      403   403    403   403    ok
GET /api/v1/customers/{slug}/utilisation                 | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/customers/{slug}/entitlements                | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
PUT /api/v1/customers/{slug}/entitlements                | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
GET /api/v1/models/{name}/capacity                       | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/models/{name}/why                            | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/health/replicas                              | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/health/incidents                             | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/health/deployments/{name}/reset-fingerprint | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/degradation/                                 | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/degradation/{model_name}/policy              | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
PUT /api/v1/degradation/{model_name}/policy              | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/gpu-types/                                   | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/gpu-types/                                  | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
DELETE /api/v1/gpu-types/{name}/                         | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/gpu-types/{name}/                            | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/gpu-types/{name}/                          | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
PUT /api/v1/gpu-types/{name}/                            | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/gpu-pools/                                   | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/gpu-pools/                                  | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
DELETE /api/v1/gpu-pools/{name}/                         | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/gpu-pools/{name}/                            | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/gpu-pools/{name}/                          | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
PUT /api/v1/gpu-pools/{name}/                            | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/models/                                      | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/models/                                     | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
DELETE /api/v1/models/{name}/                            | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/models/{name}/                               | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/models/{name}/                             | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
PUT /api/v1/models/{name}/                               | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/deployments/                                 | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/deployments/                                | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
DELETE /api/v1/deployments/{name}/                       | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/deployments/{name}/                          | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/deployments/{name}/                        | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
PUT /api/v1/deployments/{name}/                          | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/cost-models/                                 | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/cost-models/{pk}/                            | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/cost-models/{pk}/activate/                  | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
POST /api/v1/cost-models/{pk}/reject/                    | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
POST /api/v1/cost-models/{pk}/retire/                    | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
GET /api/v1/cost-models/{pk}/price-change/               | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/reservations/                                | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/reservations/                               | 401  403   403    403      403    403     403     403   403    403     403     403   ok     403   403    ok
GET /api/v1/reservations/{pk}/                           | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/reservations/{pk}/                         | 401  403   403    403      403    403     403     403   403    403     403     403   404    403   403    ok
POST /api/v1/reservations/{pk}/cancel/                   | 401  403   403    403      403    403     403     403   403    403     403     403   404    403   403    ok
GET /api/v1/reservations/{pk}/history/                   | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/request-limits/                              | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/request-limits/                             | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
DELETE /api/v1/request-limits/{pk}/                      | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
GET /api/v1/request-limits/{pk}/                         | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/request-limits/{pk}/                       | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
GET /api/v1/allocation/decisions/                        | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/allocation/decisions/{pk}/                   | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/allocation/allowances/                       | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/benchmark-suites/                            | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/benchmark-suites/                           | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
DELETE /api/v1/benchmark-suites/{name}/                  | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/benchmark-suites/{name}/                     | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/benchmark-suites/{name}/                   | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
PUT /api/v1/benchmark-suites/{name}/                     | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/benchmark-runs/                              | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/benchmark-runs/                             | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/benchmark-runs/{pk}/                         | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/benchmark-runs/{pk}/samples/                 | 401  403   403    403      403    403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/customers/{slug}/billing/estimate            | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/billing/margin                               | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
GET /api/v1/invoices/                                    | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/invoices/{pk}/                               | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/invoices/{pk}/csv/                           | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/invoices/{pk}/pdf/                           | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/invoices/{pk}/issue/                        | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   403    ok
GET /api/v1/budgets/                                     | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/budgets/                                    | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
DELETE /api/v1/budgets/{pk}/                             | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
GET /api/v1/budgets/{pk}/                                | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/budgets/{pk}/                              | 401  403   403    403      403    403     403     403   403    403     403     403   403    403   ok     ok
GET /api/v1/budgets/{pk}/spend/                          | 401  ok    ok     404      ok     403     403     403   ok     403     403     403   403    403   403    ok
GET /api/v1/rate-cards/                                  | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
POST /api/v1/rate-cards/                                 | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/v1/rate-cards/{pk}/                             | 401  ok    ok     ok       ok     403     403     403   ok     403     403     403   403    403   403    ok
PATCH /api/v1/rate-cards/{pk}/                           | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
PUT /api/v1/rate-cards/{pk}/                             | 401  403   403    403      403    403     403     403   403    403     403     403   403    ok    403    ok
GET /api/schema/                                         | ok   ok    ok     ok       ok     ok      ok      ok    ok     ok      ok      ok    ok     ok    ok     ok
GET /api/docs/                                           | ok   ok    ok     ok       ok     ok      ok      ok    ok     ok      ok      ok    ok     ok    ok     ok
"""


def _expected() -> dict[str, dict[str, str]]:
    table = {}
    for line in EXPECTED_TABLE.strip().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        endpoint, cells = line.split("|")
        values = cells.split()
        assert len(values) == len(CALLERS), f"{endpoint.strip()}: {len(values)} cells"
        table[endpoint.strip()] = dict(zip(CALLERS, values, strict=True))
    return table


def _routes():
    """(method, route as written, URL pattern) for every API endpoint."""

    def walk(patterns, prefix=""):
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                yield prefix + str(pattern.pattern), pattern

    for route, pattern in walk(get_resolver().url_patterns):
        if not route.startswith("api/") or "(?P<format>" in route:
            continue
        callback = pattern.callback
        actions = getattr(callback, "actions", None)
        view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
        allowed = set(getattr(view_class, "http_method_names", ()))
        if actions:
            # DRF adds "head" to a viewset's actions once it has served a GET: not ours.
            methods = sorted(
                m for m in actions if m not in ("head", "options") and (not allowed or m in allowed)
            )
        else:
            methods = sorted(
                m
                for m in getattr(view_class, "http_method_names", ["get"])
                if m not in ("options", "head") and hasattr(view_class, m)
            )
        readable = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", route)
        readable = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", readable)
        readable = "/" + readable.replace("^", "").replace("$", "")
        for method in methods:
            yield method.upper(), readable


@pytest.fixture
def world(acme, globex, owner, member, outsider, planner, served_model, gpu_type, deployment):
    acme.may_report_own_usage = True
    acme.save()
    cost_model = make_cost_model(served_model, gpu_type)
    reservation = Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=10,
        starts_at=datetime(2026, 11, 1, tzinfo=UTC),
        status="active",
    )
    card = rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    invoice_generate(period="2026-11")
    degradation_policy_save(served_model=served_model)
    suite = suite_create(name="suite", grid=[[64, 16]], slo_ttft_p95_ms=2000, slo_tpot_p95_ms=100)
    run = BenchmarkRun.objects.create(
        suite=suite,
        served_model=served_model,
        gpu_type=gpu_type,
        endpoint_url="http://127.0.0.1:9",
        engine_model_id="llama-8b",
    )
    decision = AllocationDecision.objects.create(
        tick_id="00000000-0000-0000-0000-000000000001",
        deployment=deployment,
        served_model=served_model,
        inputs_digest="0" * 64,
        current_replicas=0,
        recommended_replicas=0,
        target_replicas=0,
        actuator_kind="dry_run",
    )
    clients = {"anon": APIClient()}
    for name, user in (("owner", owner), ("member", member), ("outsider", outsider),
                       ("planner", planner)):  # fmt: skip
        clients[name] = APIClient()
        clients[name].force_login(user)
    keys = {}
    for name, scope in CUSTOMER_KEY_SCOPES.items():
        keys[name] = api_key_create(name=name, customer=acme, scopes=[scope])
    for name, scope in SERVICE_KEY_SCOPES.items():
        keys[name] = api_key_create(name=name, service_name="matrix", scopes=[scope])
    for name, created in keys.items():
        clients[name] = APIClient()
        clients[name].credentials(HTTP_AUTHORIZATION=f"Bearer {created.plaintext}")
    values = {
        "slug": acme.slug,
        "model_name": served_model.name,
        # A key of acme's that none of the callers is (a key may always revoke itself).
        "/api-keys/{pk}": api_key_create(name="target", customer=acme).api_key.pk,
        "/cost-models/{pk}": CostModel.objects.get().pk if cost_model else None,
        "/reservations/{pk}": reservation.pk,
        "/request-limits/{pk}": RequestLimit.objects.create(
            customer=acme, requests_per_minute=600
        ).pk,
        "/allocation/decisions/{pk}": decision.pk,
        "/benchmark-suites/{name}": suite.name,
        "/benchmark-runs/{pk}": run.pk,
        "/invoices/{pk}": Invoice.objects.get(customer=acme).pk,
        "/rate-cards/{pk}": card.pk,
        "/budgets/{pk}": Budget.objects.create(customer=acme, monthly_amount=Decimal(100)).pk,
        "/tiers/{name}": "premium",
        "/gpu-types/{name}": gpu_type.name,
        "/gpu-pools/{name}": deployment.gpu_pool.name,
        "/models/{name}": served_model.name,
        "/deployments/{name}": deployment.name,
        "/health/deployments/{name}": deployment.name,
    }
    return clients, values


def _path(route: str, values: dict) -> str:
    def fill(match):
        name = match.group(1)
        head = route[: match.start()]
        for prefix, value in values.items():
            if prefix.startswith("/") and (head + "{" + name + "}").endswith(prefix):
                return str(value)
        return str(values[name])

    return re.sub(r"\{(\w+)\}", fill, route)


def _outcome(status: int) -> str:
    return str(status) if status in (401, 403, 404, 405) else "ok"


def test_every_endpoint_answers_each_caller_as_the_table_says(world, settings):
    settings.API_THROTTLE_WRITES = None  # many writes from one key in a second
    clients, values = world
    expected = _expected()
    observed: dict[str, dict[str, str]] = {}
    for method, route in _routes():
        endpoint = f"{method} {route}"
        path = _path(route, values)
        observed[endpoint] = {}
        for caller in CALLERS:
            with transaction.atomic():
                response = clients[caller].generic(
                    method,
                    path,
                    data="{}" if method != "GET" else "",
                    content_type="application/json",
                )
                transaction.set_rollback(True)
            observed[endpoint][caller] = _outcome(response.status_code)
    if os.environ.get("MATRIX_DUMP"):
        width = max(len(e) for e in observed)
        print("\n# " + " " * (width - 1) + "| " + " ".join(CALLERS))
        for endpoint, cells in observed.items():
            print(f"{endpoint:<{width}} | " + " ".join(f"{cells[c]:<{len(c)}}" for c in CALLERS))
    missing = sorted(set(observed) - set(expected))
    assert not missing, f"endpoints without an entry in the table: {missing}"
    gone = sorted(set(expected) - set(observed))
    assert not gone, f"entries for endpoints that no longer exist: {gone}"
    wrong = [
        f"{endpoint} as {caller}: expected {expected[endpoint][caller]}, got {got}"
        for endpoint, cells in observed.items()
        for caller, got in cells.items()
        if got != expected[endpoint][caller]
    ]
    assert not wrong, "\n".join(wrong)
