"""Every endpoint, fed malformed bodies, answers 4xx in the one error shape, never 500."""

import pytest
from drf_spectacular.generators import SchemaGenerator

from capacity.models import Reservation, UsageEvent
from core.api.parsers import json_depth

pytestmark = pytest.mark.django_db

DEEP_ARRAYS = b"[" * 50_000 + b"]" * 50_000
DEEP_IN_AN_OBJECT = b'{"events": ' + DEEP_ARRAYS + b', "model": "llama-8b"}'

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
    (
        # Valid JSON whose strings are not Unicode text: half a surrogate pair (issue 34).
        "lone surrogates",
        b'{"name": "\\ud800", "scopes": ["\\ud800"], "slug": "\\udfff", "customer": "acme", '
        b'"events": [{"event_id": "\\ud800"}], "\\udbff": 1, "actuator_config": {"x": "\\ud800"}}',
        "application/json",
    ),
    ("50,000 nested arrays", DEEP_ARRAYS, "application/json"),
    ("50,000 nested arrays in an object", DEEP_IN_AN_OBJECT, "application/json"),
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


@pytest.mark.parametrize(
    ("url", "body", "field"),
    [
        ("/api/v1/api-keys/", b'{"name": "k", "customer": "acme", "scopes": ["\\ud800"]}',
         "scopes.0"),
        ("/api/v1/api-keys/", b'{"name": "k", "customer": "acme", "scopes": ["read"], '
         b'"\\udc00": 1}', "\\udc00"),
        ("/api/v1/usage/events", b'{"events": [{"event_id": "ok-1"}, {"event_id": "\\ud800"}]}',
         "events.1.event_id"),
        ("/api/v1/usage/events", b'[{"event_id": "\\udfff-1"}]', "0.event_id"),
        ("/api/v1/deployments/", b'{"name": "d", "actuator_config": {"namespace": "\\ud800"}}',
         "actuator_config.namespace"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_in_a_json_body_is_a_400_naming_its_field(
    planner_client, acme, url, body, field
):
    response = planner_client.post(url, data=body, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert list(error["fields"]) == [field]
    assert "half of a UTF-16 surrogate pair" in error["fields"][field][0]
    assert not UsageEvent.objects.exists()


def test_a_whole_surrogate_pair_and_an_escaped_backslash_are_text(planner_client, acme):
    # A pair of escapes is one character (U+1F600); an escaped backslash before "ud800" is a
    # backslash and "ud800".
    body = b'{"name": "k \\ud83d\\ude00 \\\\ud800", "customer": "acme", "scopes": ["read"]}'
    response = planner_client.post("/api/v1/api-keys/", data=body, content_type="application/json")
    assert response.status_code == 201, response.content[:300]
    assert response.json()["name"] == "k \U0001f600 \\ud800"


def test_malformed_json_is_a_400_that_says_so(planner_client):
    response = planner_client.post(
        "/api/v1/gpu-types/", data=b'{"name": ', content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "malformed_body"
    assert "JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/usage/events",
        "/api/v1/reservations/",
        "/api/v1/admission",
        "/api/v1/cost-models/estimate",
    ],
)
@pytest.mark.parametrize("body", [DEEP_ARRAYS, DEEP_IN_AN_OBJECT], ids=["bare", "in_an_object"])
def test_deeply_nested_json_is_a_400_not_a_500(planner_client, url, body):
    response = planner_client.post(url, data=body, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert error["code"] == "too_deep"
    assert "50001" in error["message"] or "50000" in error["message"]
    assert not UsageEvent.objects.exists()
    assert not Reservation.objects.exists()


def test_json_nested_to_the_limit_is_parsed_and_one_level_more_is_refused(
    planner_client, settings, sellable
):
    settings.API_MAX_JSON_DEPTH = 8

    def estimate(levels: int):
        # {"model": ..., "shapes": [[...[{"input_tokens": 1, "output_tokens": 1}]...]]}
        shape = b'{"input_tokens": 1, "output_tokens": 1}'
        nested = b"[" * (levels - 1) + shape + b"]" * (levels - 1)
        body = b'{"model": "llama-8b", "shapes": ' + nested + b"}"
        assert json_depth(body) == levels + 1
        return planner_client.post(
            "/api/v1/cost-models/estimate", data=body, content_type="application/json"
        )

    assert estimate(2).status_code == 200
    at_the_limit = estimate(7)
    assert at_the_limit.json()["error"]["code"] == "invalid"  # parsed, then validated
    assert estimate(8).json()["error"]["code"] == "too_deep"


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[{{{", "b": ["]]]"]}', 2),
        (r'["\\", [[]]]', 3),  # an escaped backslash does not escape the closing quote
        (r'["\\\"[[[", []]', 2),  # an escaped quote does not close the string
        ('{"é": ["ü"]}', 2),
        ("]]][", 0),
    ],
)
def test_the_depth_counts_brackets_outside_strings_only(text, depth):
    assert json_depth(text.encode()) == depth


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


# Digits str.isdigit() passes and int() refuses, and a year no date holds (issue 34).
SUPERSCRIPT_QUERIES = [
    {"period": "2026-²", "page": "²", "page_size": "²", "model": "²", "step": "²m"},
    {"period": "²²²²-1", "customer": "²", "from": "²²²²-01-01T00:00:00Z"},
    {"period": "99999999999-1", "page": "99999999999999999999999"},
]
CONTROL_QUERY = {
    "search": "a\x00b",
    "model": "llama-8b\x00",
    "period": "2026-11\n",
    "customer": "acme\x00",
    "page_size": "5\x00",
}
OUT_OF_RANGE_DATES = [
    {"created_at__gte": "9999-12-31T23:59:59-23:00"},
    {"created_at__lte": "9999-12-31T23:59:59-01:00"},
    {"created_at__gte": "0001-01-01T00:00:00+01:00"},
]


def test_no_read_endpoint_answers_500_to_control_characters_superscripts_or_dates_out_of_range(
    planner_client, deployment, pool, gpu_type, served_model, acme, make_key
):
    api_key, _ = make_key(customer=acme)
    schema = SchemaGenerator().get_schema(request=None, public=True)
    checked = 0
    for path, methods in schema["paths"].items():
        if "get" not in methods:
            continue
        url = _concrete(path, deployment, pool, gpu_type, served_model, acme, api_key)
        for query in (CONTROL_QUERY, *OUT_OF_RANGE_DATES, *SUPERSCRIPT_QUERIES):
            response = planner_client.get(url, query)
            assert response.status_code < 500, (url, query, response.content[:300])
            if response.status_code >= 400 and url.startswith("/api/v1/"):
                assert response.json()["error"]["status"] == response.status_code
        checked += 1
    assert checked >= 20


def test_a_query_parameter_with_a_control_character_is_a_400_naming_it(planner_client, acme):
    response = planner_client.get("/api/v1/customers/", {"slug": "acme\x00", "tier": "gold"})
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"slug": ["must not contain control characters."]}


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/models/llama%00/",
        "/api/v1/customers/acme%00/",
        "/api/v1/models/llama%00/capacity",
        "/api/v1/degradation/llama%00/policy",
        "/api/v1/health/deployments/x%0A/reset-fingerprint",
    ],
)
def test_a_name_with_a_control_character_in_the_path_is_a_404_not_a_500(
    planner_client, served_model, acme, url
):
    response = planner_client.get(url)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("query", OUT_OF_RANGE_DATES)
def test_a_date_filter_the_database_cannot_compare_is_a_400_naming_it(planner_client, acme, query):
    response = planner_client.get("/api/v1/customers/", query)
    assert response.status_code == 400
    assert list(response.json()["error"]["fields"]) == list(query)


def test_date_filters_at_the_far_ends_still_work(planner_client, acme):
    for query in ({"created_at__gte": "0001-01-01T00:00:00Z"},
                  {"created_at__lte": "9999-12-31T23:59:59+14:00"}):  # fmt: skip
        response = planner_client.get("/api/v1/customers/", query)
        assert response.status_code == 200, response.content[:300]
        assert response.json()["count"] == 1
