"""What customers may read: a public view of the catalog, and nothing without the `read` scope."""

import pytest

from accounts import scopes as S
from accounts.models import ApiKey

pytestmark = pytest.mark.django_db

HIDDEN_DEPLOYMENT_FIELDS = {
    "endpoint_url",
    "actuator_config",
    "actuator_config_problem",
    "prometheus_selector",
    "benchmark_suite",
    "benchmark_nightly",
    "benchmark_hour_utc",
}


@pytest.fixture
def configured(deployment):
    deployment.endpoint_url = "http://10.1.2.3:8000"
    deployment.actuator_kind = "webhook"
    deployment.actuator_config = {"url": "http://10.9.9.9/scale", "secret_env": "HOOK_SECRET"}
    deployment.save()
    return deployment


def rows(response):
    assert response.status_code == 200, response.content
    body = response.json()
    return body.get("results", [body])


def test_a_customer_key_with_read_sees_no_endpoints_actuator_configs_or_gpu_costs(
    acme_key_client, configured, gpu_type
):
    for path in ("/api/v1/deployments/", f"/api/v1/deployments/{configured.name}/"):
        for row in rows(acme_key_client.get(path)):
            assert not HIDDEN_DEPLOYMENT_FIELDS & set(row), path
            assert row["name"] == configured.name
    for path in ("/api/v1/gpu-types/", f"/api/v1/gpu-types/{gpu_type.name}/"):
        for row in rows(acme_key_client.get(path)):
            assert "hourly_cost_usd" not in row
            assert row["name"] == gpu_type.name
    assert "10.1.2.3" not in acme_key_client.get("/api/v1/deployments/").content.decode()


def test_a_customers_members_get_the_public_view_too(owner_client, configured, gpu_type):
    assert not HIDDEN_DEPLOYMENT_FIELDS & set(rows(owner_client.get("/api/v1/deployments/"))[0])
    assert "hourly_cost_usd" not in rows(owner_client.get("/api/v1/gpu-types/"))[0]


@pytest.mark.parametrize("who", ["planner", "service"])
def test_planners_and_service_keys_get_the_full_view(
    who, planner_client, make_key, key_client, configured, gpu_type
):
    if who == "planner":
        client = planner_client
    else:
        _, plaintext = make_key(service_name="provisioner", scopes=[S.READ])
        client = key_client(plaintext)
    deployment = rows(client.get(f"/api/v1/deployments/{configured.name}/"))[0]
    assert deployment["endpoint_url"] == "http://10.1.2.3:8000"
    assert deployment["actuator_config"]["url"] == "http://10.9.9.9/scale"
    assert rows(client.get("/api/v1/gpu-types/"))[0]["hourly_cost_usd"] == "2.5000"


def test_pools_and_models_read_the_same_for_customers(acme_key_client, configured):
    pools = rows(acme_key_client.get("/api/v1/gpu-pools/"))
    models = rows(acme_key_client.get("/api/v1/models/"))
    assert [p["name"] for p in pools] == [configured.gpu_pool.name]
    assert [m["name"] for m in models] == [configured.served_model.name]


# --- the read scope --------------------------------------------------------------------------


@pytest.fixture
def no_read_clients(make_key, key_client, acme):
    """A customer key and a platform key holding every scope but `read`."""
    acme.may_report_own_usage = True
    acme.save()
    _, customer_plain = make_key(customer=acme, scopes=[S.WRITE, S.USAGE_WRITE, S.ADMISSION])
    service_scopes = [scope for scope in S.SERVICE_SCOPES if scope != S.READ]
    _, service_plain = make_key(service_name="gateway", scopes=service_scopes)
    return {"customer": key_client(customer_plain), "service": key_client(service_plain)}


def read_operations(client):
    """Every GET of the API's schema, with each path parameter filled in."""
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for path, operations in schema["paths"].items():
        if "get" in operations and path.startswith("/api/v1/"):
            yield path
    # Reads posted as a body.
    yield "POST /api/v1/cost-models/estimate"


def fill(path: str) -> str:
    import re

    return re.sub(r"\{[^}]+\}", "acme", path)


# Who the caller is: its own identity and scopes, whatever they are.
READABLE_WITHOUT_READ = {"/api/v1/me"}


@pytest.mark.parametrize("kind", ["customer", "service"])
def test_every_read_endpoint_needs_the_read_scope(no_read_clients, anon, kind, acme, deployment):
    client = no_read_clients[kind]
    checked = []
    for operation in read_operations(anon):
        if operation in READABLE_WITHOUT_READ:
            continue
        if operation.startswith("POST "):
            path = operation.split(" ", 1)[1]
            response = client.post(path, {"model": "x", "shapes": []}, format="json")
        else:
            path = fill(operation)
            response = client.get(path)
        checked.append(operation)
        assert response.status_code == 403, (operation, response.status_code, response.content)
    assert len(checked) > 20
    assert "/api/v1/allocation/allowances/" in checked
    assert "/api/v1/customers/{slug}/utilisation" in checked
    assert "/api/v1/api-keys/" in checked
    assert "/api/v1/customers/{slug}/billing/estimate" in checked


def test_the_same_reads_answer_a_key_with_read(make_key, key_client, acme, served_model):
    _, plaintext = make_key(customer=acme, scopes=[S.READ])
    client = key_client(plaintext)
    assert client.get("/api/v1/allocation/allowances/").status_code == 200
    assert client.get("/api/v1/api-keys/").status_code == 200
    utilisation = client.get(f"/api/v1/customers/acme/utilisation?model={served_model.name}")
    assert utilisation.status_code == 200
    assert client.get("/api/v1/customers/acme/billing/estimate").status_code == 200


# --- the customer-slug oracle on key creation ------------------------------------------------


def test_another_tenants_slug_and_an_unknown_slug_answer_alike_on_key_creation(
    acme_key_client, globex
):
    foreign = acme_key_client.post(
        "/api/v1/api-keys/", {"name": "k", "customer": "globex"}, format="json"
    )
    unknown = acme_key_client.post(
        "/api/v1/api-keys/", {"name": "k", "customer": "nobody"}, format="json"
    )
    assert foreign.status_code == unknown.status_code == 400
    assert foreign.json() == {
        "error": {
            "status": 400,
            "code": "invalid",
            "message": "customer: No customer 'globex' that you may see.",
            "fields": {"customer": ["No customer 'globex' that you may see."]},
        }
    }
    assert unknown.json() == {
        "error": {
            "status": 400,
            "code": "invalid",
            "message": "customer: No customer 'nobody' that you may see.",
            "fields": {"customer": ["No customer 'nobody' that you may see."]},
        }
    }
    assert not ApiKey.objects.filter(customer=globex).exists()


def test_planners_still_create_keys_for_any_customer(planner_client, globex):
    created = planner_client.post(
        "/api/v1/api-keys/", {"name": "k", "customer": "globex"}, format="json"
    )
    assert created.status_code == 201
