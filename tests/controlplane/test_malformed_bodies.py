"""Every endpoint, fed malformed bodies, answers 4xx in the one error shape, never 500."""

import pytest
from drf_spectacular.generators import SchemaGenerator

pytestmark = pytest.mark.django_db

MALFORMED_BODIES = [
    ("broken json", b'{"name": ', "application/json"),
    ("a json list", b"[1, 2, 3]", "application/json"),
    ("a json string", b'"text"', "application/json"),
    ("null", b"null", "application/json"),
    ("empty object", b"{}", "application/json"),
    (
        "wrong types",
        b'{"name": 5, "gpu_count": "many", "max_replicas": [], "customer": {}, '
        b'"scopes": "read", "actuator_config": "x", "memory_gb": -3, "slug": "NO SPACES"}',
        "application/json",
    ),
    (
        "huge numbers",
        b'{"gpu_count": 1e400, "max_replicas": 99999999999999999999}',
        "application/json",
    ),
    ("not utf-8", b"\xff\xfe\xfa", "application/json"),
    ("form garbage", b"a=%%%", "application/x-www-form-urlencoded"),
    ("unsupported type", b"<x/>", "application/xml"),
]


def _operations():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path, methods in schema["paths"].items():
        for method in methods:
            if method in {"post", "put", "patch"}:
                yield path, method


def _concrete(path: str, deployment, pool, gpu_type, served_model, acme, api_key) -> str:
    values = {
        "{name}": "",
        "{slug}": acme.slug,
        "{id}": str(api_key.pk),
    }
    for resource, name in (
        ("deployments", deployment.name),
        ("gpu-pools", pool.name),
        ("gpu-types", gpu_type.name),
        ("models", served_model.name),
    ):
        if f"/{resource}/" in path:
            values["{name}"] = name
    for placeholder, value in values.items():
        path = path.replace(placeholder, value)
    return path


def test_the_schema_lists_the_writable_endpoints():
    operations = set(_operations())
    assert ("/api/v1/deployments/", "post") in operations
    assert ("/api/v1/api-keys/", "post") in operations
    assert len(operations) >= 10


@pytest.mark.parametrize(("label", "body", "content_type"), MALFORMED_BODIES)
def test_no_endpoint_answers_500_to_a_malformed_body(
    planner_client,
    deployment,
    pool,
    gpu_type,
    served_model,
    acme,
    make_key,
    label,
    body,
    content_type,
):
    api_key, _ = make_key(customer=acme)
    checked = 0
    for path, method in _operations():
        url = _concrete(path, deployment, pool, gpu_type, served_model, acme, api_key)
        response = getattr(planner_client, method)(url, data=body, content_type=content_type)
        assert response.status_code < 500, (method, url, label, response.content[:300])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["status"] == response.status_code
            assert error["message"]
        checked += 1
    assert checked >= 10


def test_malformed_json_is_a_400_that_says_so(planner_client):
    response = planner_client.post(
        "/api/v1/gpu-types/", data=b'{"name": ', content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "malformed_body"
    assert "JSON" in response.json()["error"]["message"]


GARBAGE_QUERY = {
    "page": "abc",
    "page_size": "-5",
    "ordering": "no_such_field",
    "created_at__gte": "not-a-date",
    "status": "nonsense",
    "customer": "../../etc",
    "model": "ghost",
    "from": "yesterday",
    "step": "fortnight",
    "search": "' OR 1=1 --",
}


def test_no_read_endpoint_answers_500_to_garbage_query_parameters(
    planner_client, deployment, pool, gpu_type, served_model, acme, make_key
):
    api_key, _ = make_key(customer=acme)
    schema = SchemaGenerator().get_schema(request=None, public=True)
    checked = 0
    for path, methods in schema["paths"].items():
        if "get" not in methods:
            continue
        url = _concrete(path, deployment, pool, gpu_type, served_model, acme, api_key)
        for query in ({}, GARBAGE_QUERY):
            response = planner_client.get(url, query)
            assert response.status_code < 500, (url, query, response.content[:300])
            if response.status_code >= 400 and url.startswith("/api/v1/"):
                assert response.json()["error"]["status"] == response.status_code
        checked += 1
    assert checked >= 20
